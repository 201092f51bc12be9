//! `run --check`: the CPU reference and CUDA side by side on the same tokens.
//!
//! The prompt goes through both backends (every position compared), then generation follows the
//! CUDA logits (sampled with the run's settings) and every step is compared again. A step fails when
//! its largest |difference| exceeds 2e-3 of the reference's largest |logit|, the tolerance of the
//! golden tests.

use std::io::Write;
use std::path::Path;

use anyhow::{Result, bail};
use cherenkov_engine::backend::{Backend, Logits};
use cherenkov_engine::sampling::Sampler;
use cherenkov_engine::tokenizer::Tokenizer;

use crate::load::open_both;
use crate::run::{RunArgs, prompt_tokens};

/// (max |diff|, max |ref|) over `got` vs `want`.
fn diff(got: &[f32], want: &[f32]) -> (f32, f32) {
    let d = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let r = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    (d, r)
}

pub fn run(store_dir: &Path, args: &RunArgs, out: &mut dyn Write) -> Result<()> {
    let (store, cpu, cuda) = open_both(store_dir, &args.load)?;
    let dir = &store.dir;
    let tok = Tokenizer::from_dir(dir)?;
    let ids = prompt_tokens(dir, &tok, args.system.as_deref(), &args.prompt, args.raw)?;
    let params = args.sampling.resolve(dir);
    params.validate()?;
    let mut sampler = Sampler::new(params);
    let mut cs = Backend::new_session(&cpu)?;
    let mut gs = cuda.new_session()?;
    let want = cpu.forward(&mut cs, &ids, Logits::All)?;
    let got = cuda.forward_tokens(&mut gs, &ids, Logits::All)?;
    let (d, r) = diff(&got, &want);
    writeln!(out, "{:>6} {:>8} {:>12} {:>12} {:>10}", "step", "token", "max |diff|", "max |ref|", "")?;
    let mut worst = d / r;
    let mut failed = 0;
    let verdict = |d: f32, r: f32| if d <= 2e-3 * r { "ok" } else { "FAIL" };
    writeln!(out, "{:>6} {:>8} {:>12.3e} {:>12.3} {:>10}", "prompt", ids.len(), d, r, verdict(d, r))?;
    if d > 2e-3 * r {
        failed += 1;
    }
    let vocab = cuda.config().vocab_size;
    let mut last = got[got.len() - vocab..].to_vec();
    let mut generated = Vec::new();
    for step in 0..args.max_tokens {
        let next = sampler.sample(&last, &generated);
        generated.push(next);
        let want = cpu.forward(&mut cs, &[next], Logits::Last)?;
        let got = cuda.forward_tokens(&mut gs, &[next], Logits::Last)?;
        let (d, r) = diff(&got, &want);
        worst = worst.max(d / r);
        if d > 2e-3 * r {
            failed += 1;
        }
        writeln!(out, "{:>6} {:>8} {:>12.3e} {:>12.3} {:>10}", step, next, d, r, verdict(d, r))?;
        last = got;
    }
    writeln!(out, "worst step: max |diff| = {:.3e} x max |ref| (tolerance 2e-3)", worst)?;
    eprintln!("cpu expert cache:\n{}", cpu.pool.stats());
    eprintln!("cuda expert cache:\n{}", cuda.pool.stats());
    if failed > 0 {
        bail!("--check: {failed} step(s) differ beyond tolerance between CPU and CUDA");
    }
    Ok(())
}
