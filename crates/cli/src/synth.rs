//! `cherenkov synth`: write a synthetic checkpoint (random weights, the real Hugging Face layout)
//! for demonstrations, tests and benchmarks.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use cherenkov_model::synth::{SynthDims, SynthOptions, SynthShape, write_checkpoint};
use indicatif::HumanBytes;

use crate::progress::bytes_bar;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// About 3.5 MB: 2 layers, 6 experts top-2, hidden 192 (the golden fixtures' proportions).
    Tiny,
    /// About 50 MB: 4 layers, 16 experts top-4, hidden 256.
    Demo,
    /// The released Qwen3.8-Flash-Next shape (48 layers, 512 experts: about 250 GB in BF16); use
    /// --layers, --experts and --ngram-base to make it fit.
    Flash,
}

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("dims").multiple(true)))]
pub struct SynthArgs {
    /// Directory to write; it must not exist or be empty.
    pub out: PathBuf,
    /// A ready-made shape (default: demo). Without a preset, --hidden, --layers, --experts, --top-k,
    /// --moe-intermediate, --vocab or --ngram-base build a scaled shape; with `flash` (the released
    /// Qwen3.8-Flash-Next shape) they change those dimensions of it; `tiny` and `demo` take none.
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// Hidden size of the scaled shape [default: 1024].
    #[arg(long, group = "dims")]
    pub hidden: Option<usize>,
    /// Decoder layers (every 4th is attention) [default: 4].
    #[arg(long, group = "dims")]
    pub layers: Option<usize>,
    /// Routed experts per layer [default: 32].
    #[arg(long, group = "dims")]
    pub experts: Option<usize>,
    /// Experts per token [default: 4].
    #[arg(long, group = "dims")]
    pub top_k: Option<usize>,
    /// Intermediate size of each routed expert [default: 512].
    #[arg(long, group = "dims")]
    pub moe_intermediate: Option<usize>,
    /// Vocabulary size, at least 500 (the bundled tokenizer's) [default: 32768].
    #[arg(long, group = "dims")]
    pub vocab: Option<usize>,
    /// Rows of the first n-gram head's table; the PLE layer has 16 heads [default: 100003].
    #[arg(long, group = "dims")]
    pub ngram_base: Option<u64>,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Scale of the router weights (larger: peakier routing).
    #[arg(long, default_value_t = 1.0)]
    pub router_gain: f32,
    /// Largest safetensors shard, in MiB (a larger tensor gets a shard of its own).
    #[arg(long, default_value_t = 1024)]
    pub shard_mib: u64,
}

impl SynthArgs {
    fn shape(&self) -> Result<SynthShape> {
        let any_dims = self.hidden.is_some()
            || self.layers.is_some()
            || self.experts.is_some()
            || self.top_k.is_some()
            || self.moe_intermediate.is_some()
            || self.vocab.is_some()
            || self.ngram_base.is_some();
        if matches!(self.preset, Some(Preset::Tiny | Preset::Demo)) && any_dims {
            anyhow::bail!(
                "--preset {} has fixed dimensions; give either a preset or dimensions (or --preset flash with dimensions)",
                if self.preset == Some(Preset::Tiny) { "tiny" } else { "demo" }
            );
        }
        if let Some(Preset::Flash) = self.preset {
            let f = SynthShape::flash();
            return Ok(SynthShape {
                hidden_size: self.hidden.unwrap_or(f.hidden_size),
                num_hidden_layers: self.layers.unwrap_or(f.num_hidden_layers),
                num_experts: self.experts.unwrap_or(f.num_experts),
                num_experts_per_tok: self.top_k.unwrap_or(f.num_experts_per_tok),
                moe_intermediate_size: self.moe_intermediate.unwrap_or(f.moe_intermediate_size),
                vocab_size: self.vocab.unwrap_or(f.vocab_size),
                ngram_vocab_size_base: self.ngram_base.unwrap_or(f.ngram_vocab_size_base),
                ..f
            });
        }
        if !any_dims {
            return Ok(match self.preset {
                Some(Preset::Tiny) => SynthShape::tiny(),
                _ => SynthShape::demo(),
            });
        }
        let d = SynthDims::default();
        Ok(SynthShape::from_dims(&SynthDims {
            hidden_size: self.hidden.unwrap_or(d.hidden_size),
            num_hidden_layers: self.layers.unwrap_or(d.num_hidden_layers),
            num_experts: self.experts.unwrap_or(d.num_experts),
            num_experts_per_tok: self.top_k.unwrap_or(d.num_experts_per_tok),
            moe_intermediate_size: self.moe_intermediate.unwrap_or(d.moe_intermediate_size),
            vocab_size: self.vocab.unwrap_or(d.vocab_size),
            ngram_vocab_size_base: self.ngram_base.unwrap_or(d.ngram_vocab_size_base),
        }))
    }
}

pub fn run(args: &SynthArgs, out: &mut dyn Write) -> Result<()> {
    let opts = SynthOptions { seed: args.seed, router_gain: args.router_gain, max_shard_bytes: args.shard_mib << 20 };
    let bar = bytes_bar("writing");
    let s = write_checkpoint(&args.shape()?, &opts, &args.out, &bar)?;
    bar.finish_and_clear();
    writeln!(
        out,
        "wrote {}: {} tensors, {} in {} shard(s); largest tensor {} ({})",
        args.out.display(),
        s.tensors,
        HumanBytes(s.tensor_bytes),
        s.shards.len(),
        s.largest.0,
        HumanBytes(s.largest.1)
    )?;
    writeln!(out, "pack it with: cherenkov prepare {} --name NAME", args.out.display())?;
    Ok(())
}
