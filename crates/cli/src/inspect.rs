//! `cherenkov inspect`: what a store holds (configuration, bytes, precisions), whether it is
//! intact (the cheap check of [`crate::integrity`]) and, with `--verify`, whether every byte still
//! matches its checksum (recorded in the store, so `run` trusts it until a file changes, or
//! refuses it when damaged).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Result, bail};
use cherenkov_model::checkpoint::Layout;
use cherenkov_model::config::{LayerType, TextConfig};
use cherenkov_model::store::{Manifest, SourceInfo, Store};
use cherenkov_registry::Registry;
use indicatif::HumanBytes;
use serde::Serialize;

use crate::integrity::{self, Health};
use crate::progress::bytes_bar;
use crate::resolve::resolve_for_inspection;
use crate::stores::dir_bytes;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// A registered name, a source URI (hf://..., disk://...), a store directory, or a checkpoint
    /// directory (packed on first use).
    pub model: String,
    /// Re-hash every file and expert record against the manifest's checksums and record the
    /// outcome in the store; exits non-zero on any mismatch.
    #[arg(long)]
    pub verify: bool,
    /// Print one JSON object (the full config included) instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Report {
    name: Option<String>,
    store: PathBuf,
    /// The source the name was registered from (a path or URI) and the commit it resolved to.
    #[serde(skip_serializing_if = "Option::is_none")]
    registered_source: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    revision: Option<String>,
    /// The checkpoint directory that was packed.
    source: SourceInfo,
    model_type: String,
    layers: Layers,
    mtp_layers: usize,
    bytes: Bytes,
    precisions: Precisions,
    config: TextConfig,
    /// The cheap check: `ok` or `damaged`, and how it knows.
    integrity: Integrity,
    #[serde(skip_serializing_if = "Option::is_none")]
    verify: Option<Vec<String>>,
}

#[derive(Serialize)]
struct Integrity {
    ok: bool,
    detail: String,
}

#[derive(Serialize)]
struct Layers {
    total: usize,
    linear_attention: usize,
    attention: usize,
    /// Zero-based decoder layers with a PLE block.
    ple: Vec<usize>,
}

#[derive(Serialize)]
struct Bytes {
    dense: u64,
    dense_tensors: usize,
    experts: u64,
    expert_record: u64,
    expert_records: u64,
    ngram: u64,
    /// Every file of the store directory.
    total: u64,
}

#[derive(Serialize)]
struct Precisions {
    /// Dense tensors per precision label (`q4g64`, `bf16`, ...).
    dense: BTreeMap<String, usize>,
    /// Labels of each expert matrix across the MoE layers.
    experts: BTreeMap<&'static str, BTreeSet<String>>,
    ngram: BTreeSet<String>,
}

/// `hf` or `mlx`.
pub fn layout_label(layout: Layout) -> &'static str {
    match layout {
        Layout::Hf => "hf",
        Layout::Mlx => "mlx",
    }
}

/// The expert matrices' precision in one label: `q4g64`, or the labels joined by `+` when they differ.
pub fn expert_precision(m: &Manifest) -> String {
    let labels: BTreeSet<String> =
        m.experts.layers.iter().flat_map(|l| l.matrices().map(|x| x.precision.label())).collect();
    labels.into_iter().collect::<Vec<_>>().join("+")
}

fn report(store: &Store, name: Option<String>, integrity: Integrity) -> Result<Report> {
    let m = &store.manifest;
    let c = &m.config;
    let file_bytes = |f: &str| m.files.get(f).map(|s| s.bytes).unwrap_or(0);
    let linear = c.layer_types.iter().filter(|t| **t == LayerType::LinearAttention).count();
    let mut dense = BTreeMap::new();
    for t in &m.tensors {
        *dense.entry(t.precision.label()).or_insert(0) += 1;
    }
    let mut experts: BTreeMap<&'static str, BTreeSet<String>> = BTreeMap::new();
    for l in &m.experts.layers {
        for (which, x) in ["gate_proj", "up_proj", "down_proj"].into_iter().zip(l.matrices()) {
            experts.entry(which).or_default().insert(x.precision.label());
        }
    }
    let ngram = m.ngram.iter().flat_map(|n| n.tables.iter().map(|t| t.precision.label())).collect();
    Ok(Report {
        name,
        store: store.dir.clone(),
        registered_source: None,
        revision: None,
        source: m.source.clone(),
        model_type: m.model_type.clone(),
        layers: Layers {
            total: c.num_hidden_layers,
            linear_attention: linear,
            attention: c.num_hidden_layers - linear,
            ple: (0..c.num_hidden_layers).filter(|&l| c.ple_index(l).is_some()).collect(),
        },
        mtp_layers: m.mtp_layers,
        bytes: Bytes {
            dense: file_bytes("dense.bin"),
            dense_tensors: m.tensors.len(),
            experts: file_bytes(&m.experts.file),
            expert_record: m.experts.record_bytes,
            expert_records: m.experts.records(),
            ngram: m.ngram.as_ref().map(|n| file_bytes(&n.file)).unwrap_or(0),
            total: dir_bytes(&store.dir)?,
        },
        precisions: Precisions { dense, experts, ngram },
        config: c.clone(),
        integrity,
        verify: None,
    })
}

fn write_text(r: &Report, m: &Manifest, out: &mut dyn Write) -> Result<()> {
    let c = &r.config;
    let h = |b: u64| HumanBytes(b).to_string();
    let join = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>().join(", ");
    writeln!(out, "model       {}", r.name.as_deref().unwrap_or("(not registered)"))?;
    writeln!(out, "store       {}", r.store.display())?;
    if let Some(src) = &r.registered_source {
        let rev = r.revision.as_deref().map(|c| format!(" at commit {c}")).unwrap_or_default();
        writeln!(out, "registered  from {src}{rev}")?;
    }
    writeln!(
        out,
        "source      {} ({} layout, fingerprint {})",
        r.source.path,
        layout_label(r.source.layout),
        r.source.fingerprint
    )?;
    writeln!(out, "model type  {}", r.model_type)?;
    writeln!(
        out,
        "layers      {}: {} linear_attention (Gated DeltaNet), {} attention",
        r.layers.total, r.layers.linear_attention, r.layers.attention
    )?;
    writeln!(
        out,
        "hidden      {} (vocab {}, {} hyper-connection streams, low rank {})",
        c.hidden_size, c.vocab_size, c.hc_count, c.hc_lowrank
    )?;
    writeln!(
        out,
        "attention   {} query heads, {} KV heads, head_dim {}, {} rotary dims",
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.rotary_dim()
    )?;
    writeln!(
        out,
        "GDN         {} key heads x {}, {} value heads x {}, conv kernel {}",
        c.linear_num_key_heads,
        c.linear_key_head_dim,
        c.linear_num_value_heads,
        c.linear_value_head_dim,
        c.linear_conv_kernel_dim
    )?;
    writeln!(
        out,
        "experts     {} routed, top-{}, intermediate {}; shared expert intermediate {}",
        c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size
    )?;
    let ple = if r.layers.ple.is_empty() {
        "none".to_string()
    } else {
        format!(
            "layers {:?} (zero-based), embed dim {}, n-gram size {}, {} heads of {} columns",
            r.layers.ple,
            c.ple_embed_dim,
            c.ngram_size,
            c.ngram_heads(),
            c.ngram_row_dim()
        )
    };
    writeln!(out, "PLE         {ple}")?;
    let qsa = match &c.qsa {
        Some(q) => format!(
            "{} heads, {} KV head, head_dim {}, budget {}, compress ratio {} (top {} blocks)",
            q.n_heads,
            q.kv_heads,
            q.head_dim,
            q.budget,
            q.compress_ratio,
            q.block_topk()
        ),
        None => "none (dense attention)".to_string(),
    };
    writeln!(out, "QSA         {qsa}")?;
    writeln!(out, "MTP         {} layer(s)", r.mtp_layers)?;
    writeln!(out, "bytes")?;
    writeln!(out, "  dense     {} ({} tensors)", h(r.bytes.dense), r.bytes.dense_tensors)?;
    writeln!(
        out,
        "  experts   {} ({} records of {}, {} MoE layers x {} experts)",
        h(r.bytes.experts),
        r.bytes.expert_records,
        h(r.bytes.expert_record),
        m.experts.layers.len(),
        m.experts.num_experts
    )?;
    let tables: Vec<String> = m
        .ngram
        .iter()
        .flat_map(|n| n.tables.iter().map(|t| format!("layer {}: {} x {}", t.layer, t.rows, t.cols)))
        .collect();
    writeln!(
        out,
        "  n-gram    {} ({})",
        h(r.bytes.ngram),
        if tables.is_empty() { "none".into() } else { tables.join(", ") }
    )?;
    writeln!(out, "  on disk   {}", h(r.bytes.total))?;
    writeln!(out, "precisions")?;
    let dense: Vec<String> = r.precisions.dense.iter().map(|(k, n)| format!("{k} x{n}")).collect();
    writeln!(out, "  dense     {}", dense.join(", "))?;
    let experts: Vec<String> = r.precisions.experts.iter().map(|(k, v)| format!("{k} {}", join(v))).collect();
    writeln!(out, "  experts   {}", experts.join("; "))?;
    writeln!(
        out,
        "  n-gram    {}",
        if r.precisions.ngram.is_empty() { "none".into() } else { join(&r.precisions.ngram) }
    )?;
    Ok(())
}

pub fn run(args: &InspectArgs, out: &mut dyn Write) -> Result<()> {
    let reg = Registry::open_default()?;
    let resolved = resolve_for_inspection(&reg, &args.model)?;
    let store = Store::open(&resolved.store)?;
    let (verify, integrity) = if args.verify {
        let bar = bytes_bar("verifying");
        let problems = store.verify(&bar)?;
        bar.finish_and_clear();
        integrity::record(&store.dir, &store.manifest, "verified", &problems);
        let detail = if problems.is_empty() {
            "ok: every byte verified now".to_string()
        } else {
            format!("DAMAGED (found by verified, now): {}", problems.join("; "))
        };
        (Some(problems.clone()), Integrity { ok: problems.is_empty(), detail })
    } else {
        let health = integrity::quick_check(&store)?;
        (None, Integrity { ok: !matches!(health, Health::Damaged { .. }), detail: integrity::describe(&health) })
    };
    let ok = integrity.ok;
    let mut r = report(&store, resolved.name, integrity)?;
    if let Some(e) = &resolved.entry {
        r.registered_source = Some(e.source.clone());
        r.revision = e.revision.clone();
    }
    r.verify = verify;
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&r)?)?;
    } else {
        write_text(&r, &store.manifest, out)?;
        if r.verify.is_none() {
            writeln!(out, "integrity   {}", r.integrity.detail)?;
        }
        match &r.verify {
            Some(p) if p.is_empty() => {
                writeln!(out, "verify      ok: every file and expert record matches its checksum")?
            }
            Some(p) => {
                writeln!(out, "verify      {} problem(s):", p.len())?;
                for line in p {
                    writeln!(out, "  {line}")?;
                }
            }
            None => {}
        }
    }
    let again = match &r.registered_source {
        Some(_) => format!("prepare it again: cherenkov prepare {} --repack", r.name.as_deref().unwrap_or_default()),
        None => "prepare the model again with --repack".to_string(),
    };
    match &r.verify {
        Some(p) if !p.is_empty() => {
            bail!("store {} failed verification ({} problem(s)); {again}", store.dir.display(), p.len())
        }
        None if !ok => bail!("store {} is damaged: {}; {again}", store.dir.display(), r.integrity.detail),
        _ => Ok(()),
    }
}
