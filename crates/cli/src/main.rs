//! The `cherenkov` command line. Subcommands only: each lives in its own module with its
//! arguments and a `run`; model logic stays in the library crates.
//!
//! Adding a subcommand: a module with `XArgs` (clap `Args`) and `run`, a variant of [`Command`],
//! and one arm in [`dispatch`].

mod backend;
mod bench;
mod check;
mod client;
mod dash;
mod demo;
mod fetch;
mod gc;
mod gpu_check;
mod inspect;
mod integrity;
mod load;
mod logits;
mod models;
mod prepare;
mod progress;
mod resolve;
mod run;
mod serve;
mod source;
mod space;
mod stats;
mod status;
mod store;
mod stores;
mod synth;

use std::io::Write;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

const ABOUT: &str = "Run Mixture-of-Experts models larger than accelerator memory";

const LONG_ABOUT: &str = "\
Cherenkov runs qwen4_exp Mixture-of-Experts models whose routed experts do not fit in memory: dense \
weights stay resident and experts stream from a packed on-disk store.

Models are registered by name in $CHERENKOV_HOME (default: the user data directory, e.g. \
~/.local/share/cherenkov): registry.json maps names to stores, and `prepare` writes stores to \
$CHERENKOV_HOME/stores/<name>.

Wherever a command takes a MODEL, it accepts a registered name, a source URI it was prepared from \
(hf://org/repo[@revision], disk://STORE/path[@revision]), a store directory (with manifest.json) or a \
checkpoint directory (with config.json; packed on first use and registered under the directory's \
name). `cherenkov MODEL PROMPT` is short for `cherenkov run MODEL PROMPT`.";

const EXAMPLES: &str = "\
Examples:
  cherenkov demo
  cherenkov run flash 'Explain hash collisions.' --max-tokens 256
  cherenkov flash 'Explain hash collisions.' --temperature 0
  cherenkov logits flash --tokens 1,2,3 --out logits.npy
  cherenkov prepare /models/Qwen4-Exp-MLX-4bit --name flash
  cherenkov prepare hf://Org/Qwen4-Exp-MLX-4bit@main --name flash
  cherenkov store add models /models && cherenkov prepare disk://models/Org/Qwen4-Exp-MLX-4bit
  cherenkov model list
  cherenkov status
  cherenkov stats summary
  cherenkov dash
  cherenkov inspect flash --verify
  cherenkov synth /tmp/demo-ckpt --preset demo && cherenkov prepare /tmp/demo-ckpt --name demo";

#[derive(Parser, Debug)]
#[command(name = "cherenkov", version, about = ABOUT, long_about = LONG_ABOUT, after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text from a prompt, streamed to stdout; cache statistics go to stderr.
    #[command(
        long_about = "Generate text from a prompt. The prompt is the user message of the model's chat \
            template (thinking disabled) unless --raw; text streams to stdout as it is decoded; a summary \
            (prompt and decode tokens/s, expert-cache hit rate, bytes read per token, time waiting on \
            reads) goes to stderr. Sampling defaults come from the model's generation_config.json; \
            --temperature 0 is greedy. Stops at an EOS token or after --max-tokens.",
        after_help = "Examples:\n  cherenkov run flash 'Explain hash collisions.'\n  \
            cherenkov run flash 'Write a haiku.' --temperature 0.7 --top-p 0.9 --seed 42 --expert-cache 8G\n  \
            cherenkov run ./checkpoint-dir 'hello' --raw --max-tokens 16 --layers"
    )]
    Run(run::RunArgs),
    /// Write the float32 logits of one full forward over given tokens to a .npy file.
    #[command(after_help = "Examples:\n  cherenkov logits flash --tokens 1,2,3 --out logits.npy\n  \
            cherenkov logits flash --text 'The quick brown fox' --out logits.npy")]
    Logits(logits::LogitsArgs),
    /// Synthesize a small model, pack it and generate with half of its experts cached (no network).
    #[command(long_about = "Runs the whole pipeline on a model made here, with no download: writes a \
            synthetic qwen4_exp checkpoint (random weights, so the text is gibberish) under \
            $CHERENKOV_HOME/demo, packs it into a store registered as `demo`, and generates with an expert \
            cache that holds half of the experts, printing the cache statistics per layer. Later runs \
            reuse the checkpoint and the store.")]
    Demo(demo::DemoArgs),
    /// Measure decode on a synthetic model of the released shape on the GPU (writes benchmark/results).
    #[command(long_about = "Measures, on the GPU, decode of a synthetic model of the released Qwen3.8-Flash-Next \
            shape (random weights, skewed synthetic routers whose lookahead is right about 80% of the time, \
            as published cross-layer predictors are; --synthetic-routing) at --layers depth: every expert resident (also at half \
            the depth, to split per-token from per-layer time for the 48-layer figures); the expert cache a \
            --gpu-memory budget leaves the full 48-layer model, with the expert file pinned in the page cache, read \
            by the CPU, and cold, with the deadline cut, without the lookahead, and with misses computed on the CPU \
            (--cpu-experts, pinned and not); hit rates, lookahead accuracy, \
            bytes read per token (and how much of it was prefetched and never used), the time split, per-load read and copy times, the offline cache-policy study (LRU, \
            LRFU at three decays, adaptive LRFU, Belady, replayed from the prompt on so they start as warm as the pool did) on the routing trace, \
            the roofline ratios at the run's depth and at 48 layers (the HBM roofline counts the weights a token \
            reads, and a second, stricter one also the GDN recurrent states it reads and writes; the PCIe bound counts only the bytes steps used, \
            at the higher of two measured pinned host-to-device rates: from a fresh pinned buffer and from the pinned \
            expert file), and transformers' eager qwen4_exp on the same shape. Results go to --out as \
            markdown and JSON. The synthetic store is written once per depth, experts and n-gram base under \
            $CHERENKOV_HOME/bench and reused (the released shape takes about 1.4 GiB a layer); a store that \
            would not fit on its disk is refused before it is written, naming the other stores there.")]
    Bench(bench::BenchArgs),
    /// Check the CUDA backend against the CPU reference and the golden logits (on a GPU machine).
    #[command(hide = true)]
    GpuCheck(gpu_check::GpuCheckArgs),
    /// Pack a checkpoint (a directory, hf://org/repo@rev, disk://STORE/path) into a store and register it.
    #[command(
        long_about = "Pack a checkpoint into a store and register it under a name.\n\n\
            The checkpoint is a directory, hf://org/repo[@revision] (downloaded from HF_ENDPOINT, default \
            https://huggingface.co, with HF_TOKEN if set, into the Hugging Face cache HF_HUB_CACHE or \
            HF_HOME/hub; resumed if interrupted, every file's hash checked; free space for the download and \
            the store is checked first; the files it downloaded are removed after packing unless \
            --keep-source), disk://STORE/path[@revision] (a checkpoint in a disk store, see `cherenkov store`), \
            or a registered name (its source again).\n\n\
            Validates the whole checkpoint first (config, every tensor's presence, shape and dtype), then \
            writes $CHERENKOV_HOME/stores/<NAME>: dense weights in their source precision (BF16 linears \
            quantized to 4-bit groups of 64, routers to 8-bit, n-gram rows to 4-bit groups of 32; MLX \
            weights kept bit for bit), one aligned record per expert, the n-gram table, and the tokenizer \
            files. The store is built in a temporary directory and renamed into place only when complete, \
            so an error or an interrupt leaves nothing registered.\n\n\
            If a complete, undamaged store packed from a checkpoint with the same fingerprint (or, for \
            hf://, the same commit) exists, it is reused and only the name is registered; --repack packs \
            anew. If NAME is registered to a different source, prepare refuses unless --force is given.",
        after_help = "Examples:\n  cherenkov prepare /models/Qwen4-Exp-MLX-4bit --name flash\n  \
            cherenkov prepare hf://Org/Qwen4-Exp-MLX-4bit@6cc9bbc0 --name flash\n  \
            HF_TOKEN=hf_... cherenkov prepare hf://Org/Gated-Model --name gated --keep-source\n  \
            cherenkov prepare disk://models/Org/Qwen4-Exp-MLX-4bit --name flash\n  \
            cherenkov prepare disk://hfcache/Org/Qwen4-Exp-MLX-4bit@main\n  \
            cherenkov prepare flash --repack\n  \
            cherenkov prepare ./my-finetune --name flash --force"
    )]
    Prepare(prepare::PrepareArgs),
    /// List registered models, release one, or delete the stores no name uses (gc).
    #[command(subcommand)]
    Model(models::ModelCommand),
    /// Register, list or remove disk stores: directories of checkpoints that disk:// URIs name.
    #[command(subcommand)]
    Store(store::StoreCommand),
    /// Show registered models, free disk, NVIDIA GPUs and running servers.
    #[command(after_help = "Examples:\n  cherenkov status\n  cherenkov status --json")]
    Status(status::StatusArgs),
    /// Show a model's configuration, sizes on disk, precisions and integrity; --verify re-hashes the store.
    #[command(after_help = "Examples:\n  cherenkov inspect flash\n  cherenkov inspect flash --verify\n  \
            cherenkov inspect ~/.local/share/cherenkov/stores/flash --json")]
    Inspect(inspect::InspectArgs),
    /// Write a synthetic qwen4_exp checkpoint with random weights (for demos and benchmarks).
    #[command(
        long_about = "Write a synthetic qwen4_exp checkpoint with random BF16 weights in the Hugging Face \
            layout (sharded safetensors with an index, config.json, a small tokenizer and chat template). \
            Its outputs are meaningless; it exists to try the tools and to measure them at any size \
            without downloading a model. The weights are generated and written tensor by tensor, so \
            checkpoints of many GB need little memory.",
        after_help = "Examples:\n  cherenkov synth /tmp/tiny --preset tiny\n  \
            cherenkov synth /tmp/bench --hidden 2048 --layers 8 --experts 64 --moe-intermediate 512"
    )]
    Synth(synth::SynthArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (chat and text completions).
    #[command(
        long_about = "Serve the model over an OpenAI-compatible HTTP API at http://127.0.0.1:8080/v1, under \
            the model name `cherenkov` (the registered name works too): chat completions (the chat template \
            with thinking disabled) and text completions, streamed or not, with sampling, stop strings and \
            token sequences, logprobs and usage. The model stays loaded; up to two requests decode \
            interleaved (--max-active) and more wait in a bounded queue (429 when it is full). Repeated \
            prompt prefixes are restored from a cache of session snapshots; a `session_id` keeps one \
            conversation's state. --config FILE.toml sets defaults, flags override it, and SIGHUP reloads \
            it. See docs/server.md.",
        after_help = "Examples:\n  cherenkov serve --model flash\n  \
            cherenkov serve --model flash --port 9000 --config serve.toml\n  \
            CHERENKOV_API_KEY=secret cherenkov serve --model flash --host 0.0.0.0"
    )]
    Serve(serve::ServeArgs),
    /// A running server's statistics: summary, per-layer and per-expert tables, recent steps.
    #[command(
        subcommand,
        long_about = "Ask a running `cherenkov serve` (from another terminal) what the expert cache and the \
            engine are doing: `summary` (requests, tokens/s, time split, cache totals, prefix cache, MTP), \
            `layers` (one row per MoE layer: hit rate, reads, bytes, read latency, waiting, residency, \
            lookahead), `experts LAYER` (one row per expert of a layer), `steps` (the latest forwards). \
            --json prints the server's document with every field (docs/stats.md). The server is --url, \
            else --port on 127.0.0.1, else one announced in $CHERENKOV_HOME/servers, else \
            http://127.0.0.1:8080.",
        after_help = "Examples:\n  cherenkov stats summary\n  cherenkov stats layers\n  cherenkov stats experts 7\n  \
            cherenkov stats layers --json\n  cherenkov stats summary --url http://10.0.0.5:9000"
    )]
    Stats(stats::StatsCommand),
    /// A live terminal dashboard of a running server (refreshes about once a second).
    #[command(
        long_about = "A terminal dashboard of a running `cherenkov serve`: a summary (tokens/s, hit rate, reads, \
            time split, prefix cache, MTP), a sparkline of generated tokens per second over the last minute, \
            and a table of the MoE layers (hit rate, reads, bytes, read latency, waiting, residency, \
            lookahead). Up/Down select a row, PageUp/PageDown page, Enter opens the selected layer's experts, \
            Escape returns, q quits. When the server stops answering it shows \"waiting for the server at \
            URL\" and reconnects when one answers again. The server is chosen as for `cherenkov stats`.",
        after_help = "Examples:\n  cherenkov dash\n  cherenkov dash --port 9000\n  cherenkov dash --url http://10.0.0.5:8080 --interval 2"
    )]
    Dash(dash::DashArgs),
}

fn dispatch(command: &Command, out: &mut dyn Write) -> Result<()> {
    match command {
        Command::Run(a) => run::run(a, out),
        Command::Logits(a) => logits::run(a, out),
        Command::Demo(a) => demo::run(a, out),
        Command::GpuCheck(a) => gpu_check::run(a, out),
        Command::Bench(a) => bench::run(a, out),
        Command::Prepare(a) => prepare::run(a, out),
        Command::Model(c) => models::run(c, out),
        Command::Store(c) => store::run(c, out),
        Command::Status(a) => status::run(a, out),
        Command::Inspect(a) => inspect::run(a, out),
        Command::Synth(a) => synth::run(a, out),
        Command::Serve(a) => serve::run(a, out),
        Command::Stats(c) => stats::run(c, out),
        Command::Dash(a) => dash::run(a, out),
    }
}

/// A closed stdout (`cherenkov model list | head -1`) ends the command quietly.
fn broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

/// `cherenkov MODEL PROMPT ...` is `cherenkov run MODEL PROMPT ...`: a first argument that is
/// neither a subcommand nor a flag names a model.
fn with_implicit_run(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    use clap::CommandFactory;
    if let Some(first) = args.get(1).and_then(|a| a.to_str()) {
        let cmd = Cli::command();
        let known = cmd.get_subcommands().any(|s| s.get_name() == first || s.get_all_aliases().any(|a| a == first));
        if !first.starts_with('-') && !known && first != "help" {
            args.insert(1, "run".into());
        }
    }
    args
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(with_implicit_run(std::env::args_os().collect()));
    let mut out = std::io::stdout().lock();
    let result = dispatch(&cli.command, &mut out).and_then(|()| Ok(out.flush()?));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
