//! `cherenkov gpu-check`: the CUDA backend against the CPU reference and the golden logits, in one
//! run on a GPU machine (tools/gpu/check.sh calls it). Every kernel is compared with the CPU on
//! fresh random inputs; the golden fixtures run on CUDA with the CPU tests' tolerances.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use cherenkov_cuda::check::{CheckRow, run_all};
use cherenkov_model::checkpoint::Checkpoint;
use cherenkov_model::safetensors::SafeTensors;
use cherenkov_model::store::{Store, pack::pack};

use crate::load::{LoadArgs, cpu_model, cuda_model};

#[derive(clap::Args, Debug)]
pub struct GpuCheckArgs {
    /// The golden fixtures directory.
    #[arg(long, default_value = "fixtures/golden")]
    pub fixtures: PathBuf,
    /// Also check the blocks of this store (e.g. a synthetic model of the released shape).
    #[arg(long, value_name = "STORE")]
    pub store: Vec<PathBuf>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

fn golden(file: &Path) -> Result<(Vec<u32>, Vec<f32>, usize)> {
    let st = SafeTensors::open(file)?;
    let t = st.get("tokens").context("golden file without tokens")?;
    let tokens = st.read(t)?.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect();
    let l = st.get("logits").context("golden file without logits")?;
    let vocab = l.shape[1];
    let logits = st.read(l)?.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    Ok((tokens, logits, vocab))
}

/// (max |diff| / max |ref|, top-1 agreement where the reference margin exceeds 1e-2).
fn compare(got: &[f32], want: &[f32], vocab: usize) -> (f64, bool, usize) {
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let max_diff = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) as f64;
    let argmax = |r: &[f32]| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|x| x.0).unwrap_or(0);
    let mut agree = true;
    let mut compared = 0;
    for (g, w) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)) {
        let mut s = w.to_vec();
        s.sort_by(|a, b| b.total_cmp(a));
        if s[0] - s[1] > 1e-2 {
            compared += 1;
            agree &= argmax(g) == argmax(w);
        }
    }
    (max_diff / max_ref.max(1e-30), agree, compared)
}

fn load_args(expert_cache: Option<String>) -> LoadArgs {
    LoadArgs { expert_cache, io_threads: 4, max_context: 4096, ..LoadArgs::default() }
}

pub fn run(args: &GpuCheckArgs, out: &mut dyn Write) -> Result<()> {
    let info = cherenkov_cuda::gpu::probe()?;
    writeln!(
        out,
        "GPU: {} (compute capability {}.{}), {:.1} GiB free of {:.1} GiB",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.free_bytes as f64 / (1u64 << 30) as f64,
        info.total_bytes as f64 / (1u64 << 30) as f64
    )?;
    let tmp = std::env::temp_dir().join(format!("cherenkov-gpu-check-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let mut stores = Vec::new();
    for v in ["tiny-a/hf", "tiny-a/mlx4", "tiny-b/hf", "tiny-b/mlx4", "tiny-b/mlx-mixed"] {
        let dir = tmp.join(v.replace('/', "-"));
        if !dir.join("manifest.json").exists() {
            let ck = Checkpoint::open(&args.fixtures.join(v))?;
            pack(&ck, &dir, &indicatif::ProgressBar::hidden())?;
        }
        stores.push((v.to_string(), dir));
    }
    let mut rows: Vec<CheckRow> = Vec::new();
    let mut failures = Vec::new();

    // Kernels and blocks against the CPU, on fresh random inputs.
    let mut block_stores: Vec<(String, PathBuf)> =
        stores.iter().filter(|(v, _)| v == "tiny-a/mlx4" || v == "tiny-b/mlx-mixed").cloned().collect();
    block_stores.extend(args.store.iter().map(|p| (p.display().to_string(), p.clone())));
    for (i, (label, dir)) in block_stores.iter().enumerate() {
        let store = Arc::new(Store::open(dir)?);
        let cpu = cpu_model(store.clone(), &load_args(None))?;
        let cuda = cuda_model(store.clone(), &load_args(None))?;
        let r = run_all(&cuda, &cpu, args.seed + i as u64, label)?;
        rows.extend(if i == 0 { r } else { r.into_iter().filter(|r| !r.name.starts_with("matvec")).collect() });
    }
    writeln!(out, "\nkernels against the CPU reference (||gpu - cpu|| / ||cpu||):")?;
    for r in &rows {
        writeln!(
            out,
            "  {:<70} {:>10.2e}  (limit {:.0e})  {}",
            r.name,
            r.rel_err,
            r.limit,
            if r.ok() { "ok" } else { "FAIL" }
        )?;
        if !r.ok() {
            failures.push(r.name.clone());
        }
    }

    // Golden fixtures on CUDA.
    writeln!(out, "\ngolden fixtures on CUDA (max |diff| / max |ref|, tolerance 2e-3; top-1 where margin > 1e-2):")?;
    for (v, dir) in &stores {
        let gfile = if v.ends_with("mixed") { "golden-mixed.safetensors" } else { "golden-mlx4.safetensors" };
        let (tokens, want, vocab) = golden(&args.fixtures.join(v.split('/').next().unwrap()).join(gfile))?;
        for cache in [None, Some("6x".to_string())] {
            let store = Arc::new(Store::open(dir)?);
            let record = store.record_bytes();
            let ec = cache.as_ref().map(|_| (6 * record).to_string());
            let cuda = cuda_model(store.clone(), &load_args(ec))?;
            let mut s = cuda.new_session()?;
            let split = tokens.len() / 3;
            let mut got = cuda.forward_tokens(&mut s, &tokens[..split], cherenkov_engine::backend::Logits::All)?;
            for &t in &tokens[split..] {
                got.extend(cuda.forward_tokens(&mut s, &[t], cherenkov_engine::backend::Logits::Last)?);
            }
            let (rel, agree, compared) = compare(&got, &want, vocab);
            let stats = cuda.pool.stats();
            let what = format!(
                "{v} ({}; {} evictions)",
                if cache.is_some() { "6 expert slots" } else { "every expert cached" },
                stats.total.evictions
            );
            let ok = rel <= 2e-3 && agree;
            writeln!(
                out,
                "  {what:<48} {rel:>10.2e}  top-1 {} on {compared} rows  {}",
                if agree { "agrees" } else { "DIFFERS" },
                if ok { "ok" } else { "FAIL" }
            )?;
            if !ok {
                failures.push(what);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    if !failures.is_empty() {
        bail!("{} check(s) failed: {}", failures.len(), failures.join("; "));
    }
    writeln!(out, "\nall checks passed")?;
    Ok(())
}
