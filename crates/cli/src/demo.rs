//! `cherenkov demo`: the whole pipeline on a model made here, with no download.
//!
//! Writes a synthetic `qwen4_exp` checkpoint (random weights: the text is gibberish by design),
//! packs it into a store, and generates with an expert cache that holds half of the experts, so
//! the run shows hits, misses, evictions and reads. Everything lives under
//! `$CHERENKOV_HOME/demo` and is reused by later runs.

use std::io::Write;

use anyhow::Result;
use cherenkov_model::synth::{SynthOptions, SynthShape, write_checkpoint};
use cherenkov_registry::Registry;

use crate::load::LoadArgs;
use crate::prepare::{open_checkpoint, prepare_checkpoint};
use crate::progress::bytes_bar;
use crate::run::{RunArgs, SamplingArgs};

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// The prompt.
    #[arg(long, default_value = "Explain hash collisions.")]
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 48, value_name = "N")]
    pub max_tokens: usize,
}

pub fn run(args: &DemoArgs, out: &mut dyn Write) -> Result<()> {
    let reg = Registry::open_default()?;
    let ckpt = reg.home().join("demo").join("checkpoint");
    let shape = SynthShape::demo();
    if !ckpt.join("config.json").exists() {
        eprintln!("writing a synthetic checkpoint (random weights) to {}", ckpt.display());
        if ckpt.exists() {
            std::fs::remove_dir_all(&ckpt)?;
        }
        let bar = bytes_bar("synthesizing");
        write_checkpoint(&shape, &SynthOptions { seed: 7, ..SynthOptions::default() }, &ckpt, &bar)?;
        bar.finish_and_clear();
    }
    let ck = open_checkpoint(&ckpt)?;
    let p = prepare_checkpoint(&reg, &ck, "demo", true)?;
    eprintln!("{} store {}", if p.reused { "reusing" } else { "packed" }, p.entry.store.display());
    let store = cherenkov_model::store::Store::open(&p.entry.store)?;
    // Half of the experts: enough for every step, small enough that experts are evicted and read.
    let half = store.manifest.experts.records() / 2 * store.manifest.experts.record_bytes;
    drop(store);
    let run_args = RunArgs {
        model: "demo".into(),
        prompt: args.prompt.clone(),
        max_tokens: args.max_tokens,
        sampling: SamplingArgs { temperature: Some(0.8), top_p: Some(0.95), top_k: None, seed: Some(1) },
        system: None,
        raw: false,
        layers: true,
        draft: 0,
        check: false,
        load: LoadArgs {
            expert_cache: Some(half.to_string()),
            io_threads: 4,
            max_context: 8192,
            ..LoadArgs::default()
        },
    };
    writeln!(out, "--- {} (synthetic weights: expect gibberish) ---", run_args.prompt)?;
    crate::run::run(&run_args, out)
}
