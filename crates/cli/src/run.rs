//! `cherenkov run MODEL PROMPT`: generate text, streamed to stdout, with cache statistics on stderr.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use cherenkov_engine::backend::Backend;
use cherenkov_engine::chat::{ChatTemplate, Message, eos_token_ids};
use cherenkov_engine::generate::{GenerateOptions, Generation, generate};
use cherenkov_engine::residency::format_bytes;
use cherenkov_engine::sampling::SamplingParams;
use cherenkov_engine::stats::{ForwardStats, PoolStats};
use cherenkov_engine::tokenizer::Tokenizer;
use cherenkov_registry::Registry;

use crate::load::{LoadArgs, open_model};
use crate::resolve::resolve_model;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// A registered name, a store directory, or a checkpoint directory (packed on first use).
    pub model: String,
    /// The user message (rendered with the model's chat template unless --raw).
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// A system message placed before the prompt.
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Feed the prompt as it is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Print the per-layer expert-cache table after the text.
    #[arg(long)]
    pub layers: bool,
    /// Speculative decoding: tokens the checkpoint's MTP head drafts per decode step (0: off; 1 is
    /// the most supported). The trunk checks the draft in the same forward as the token before it
    /// and keeps it where its own sample agrees, so the text is the same as without drafting; the
    /// summary reports how many drafts were accepted. On CUDA the draft and its token are checked
    /// in one pass over both rows where every expert is resident (elsewhere as two steps): the
    /// same text, faster only at depth and high acceptance (at 80% acceptance the bench measured
    /// 0.82-0.84x plain decoding at 8 layers, 1.03x at 32 and about 1.07x at 48).
    #[arg(long, default_value_t = 0, value_name = "N", value_parser = clap::value_parser!(u8).range(0..=cherenkov_engine::generate::MAX_DRAFT as i64))]
    pub draft: u8,
    /// Run the CPU reference beside CUDA on the same tokens and report the largest logit difference
    /// per step; fail if one exceeds 2e-3 of the reference's largest logit.
    #[arg(long)]
    pub check: bool,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// Sampling flags. Unset values come from the model's generation_config.json, then from the
/// engine's defaults (temperature 1, no top-p or top-k).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// 0 means greedy (always the most likely token).
    #[arg(long, value_name = "T")]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass (0 < P <= 1).
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Keep the K most likely tokens (0: off).
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Seed of the sampler; the same seed, prompt and settings give the same text.
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// generation_config.json's defaults, overridden by the flags.
    pub fn resolve(&self, store_dir: &Path) -> SamplingParams {
        let mut p = SamplingParams::default();
        if let Ok(text) = std::fs::read_to_string(store_dir.join("generation_config.json"))
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
        {
            let sample = v.get("do_sample").and_then(|d| d.as_bool()).unwrap_or(true);
            if !sample {
                p.temperature = 0.0;
            } else {
                if let Some(t) = v.get("temperature").and_then(|x| x.as_f64()) {
                    p.temperature = t as f32;
                }
                if let Some(t) = v.get("top_p").and_then(|x| x.as_f64()) {
                    p.top_p = t as f32;
                }
                if let Some(t) = v.get("top_k").and_then(|x| x.as_u64()) {
                    p.top_k = t as usize;
                }
            }
        }
        if let Some(t) = self.temperature {
            p.temperature = t;
        }
        if let Some(t) = self.top_p {
            p.top_p = t;
        }
        if let Some(t) = self.top_k {
            p.top_k = t;
        }
        p.seed = self.seed;
        p
    }
}

/// The prompt's tokens: the chat template with thinking disabled, or the raw text.
pub fn prompt_tokens(
    store_dir: &Path,
    tok: &Tokenizer,
    system: Option<&str>,
    prompt: &str,
    raw: bool,
) -> Result<Vec<u32>> {
    let text = if raw {
        prompt.to_string()
    } else {
        match ChatTemplate::from_dir(store_dir)? {
            Some(t) => {
                let mut msgs = Vec::new();
                if let Some(s) = system {
                    msgs.push(Message::system(s));
                }
                msgs.push(Message::user(prompt));
                t.render(&msgs, true)?
            }
            None => {
                eprintln!("note: the model has no chat template; the prompt is used as it is");
                prompt.to_string()
            }
        }
    };
    let ids = tok.encode(&text, false)?;
    if ids.is_empty() {
        anyhow::bail!("the prompt encodes to no tokens");
    }
    Ok(ids)
}

pub fn run(args: &RunArgs, out: &mut dyn Write) -> Result<()> {
    let reg = Registry::open_default()?;
    let resolved = resolve_model(&reg, &args.model)?;
    if args.check {
        return crate::check::run(&resolved.store, args, out);
    }
    let loaded = open_model(&resolved.store, &args.load)?;
    let dir = &loaded.store.dir;
    let tok = Tokenizer::from_dir(dir)?;
    let ids = prompt_tokens(dir, &tok, args.system.as_deref(), &args.prompt, args.raw)?;
    let eos = eos_token_ids(dir, &loaded.store.config().eos_token_ids, &tok);
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: args.sampling.resolve(dir),
        stop_tokens: eos,
        stop_strings: vec![],
        draft: args.draft as usize,
    };
    opts.sampling.validate()?;
    let model = &loaded.model;
    let mut session = model.new_session()?;
    eprintln!("backend: {}", model.name());
    let before = model.pool_stats();
    let forward_before = model.forward_stats();
    let mut write_err = None;
    let generation = generate(model, &mut session, &ids, &tok, &opts, &mut |text| {
        let r = out.write_all(text.as_bytes()).and_then(|_| out.flush());
        match r {
            Ok(()) => true,
            Err(e) => {
                write_err = Some(e);
                false
            }
        }
    })?;
    if let Some(e) = write_err {
        return Err(e).context("writing the generated text");
    }
    writeln!(out)?;
    let stats = model.pool_stats();
    eprintln!("{}", summary(&generation, &before, &stats));
    if let (Some(a), Some(b)) = (forward_before, model.forward_stats()) {
        eprintln!("{}", time_split(&b.since(&a)));
    }
    if args.layers {
        eprintln!("{stats}");
    }
    Ok(())
}

/// Where the forwards' time went: `[time: 1234 ms in 25 forwards: dense 61%, routed experts 35%,
/// waiting on reads 4%]`.
pub fn time_split(f: &ForwardStats) -> String {
    let share = |ns: u64| if f.total_ns > 0 { 100.0 * ns as f64 / f.total_ns as f64 } else { 0.0 };
    format!(
        "[time: {:.0} ms in {} forwards: dense {:.0}%, routed experts {:.0}%, waiting on reads {:.0}%]",
        f.total_ns as f64 / 1e6,
        f.forwards,
        share(f.dense_ns()),
        share(f.experts_ns),
        share(f.wait_ns)
    )
}

/// One paragraph: tokens and speeds, then what the expert cache did.
pub fn summary(g: &Generation, before: &PoolStats, after: &PoolStats) -> String {
    let t = &g.timing;
    let hits = after.total.hits - before.total.hits;
    let routed = after.total.routed - before.total.routed;
    let bytes = after.total.bytes_read - before.total.bytes_read;
    let waited = (after.total.wait_ns - before.total.wait_ns) as f64 / 1e6;
    let tokens = (t.prompt_tokens + t.completion_tokens).max(1) as u64;
    format!(
        "[{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s ({}), seed {}]\n\
         [expert cache: {:.1}% hits over {} routed experts, {} read ({} per token), {:.0} ms waiting on reads]",
        t.prompt_tokens,
        t.prefill_tps(),
        t.completion_tokens,
        t.decode_tps(),
        g.finish.as_str(),
        g.seed,
        if routed > 0 { 100.0 * hits as f64 / routed as f64 } else { 0.0 },
        routed,
        format_bytes(bytes),
        format_bytes(bytes / tokens),
        waited
    ) + &match t.acceptance() {
        Some(a) => format!(
            "\n[MTP drafts: {} of {} accepted ({:.1}%), {:.2} tokens per decode step]",
            t.accepted,
            t.drafted,
            100.0 * a,
            t.decode_tokens as f64 / t.decode_steps.max(1) as f64
        ),
        None => String::new(),
    }
}
