//! The transformers peer of `cherenkov bench`: HF transformers' eager `qwen4_exp` on the same
//! synthetic shape (`tools/bench/hf_peer.py`), run first and alone on the GPU at the two depths
//! that fit it, and extrapolated per layer to 48 as Cherenkov's own figures are.

use std::io::Write;

use anyhow::{Context, Result};
use cherenkov_engine::residency::format_bytes;
use cherenkov_model::arch;
use cherenkov_model::config::{LayerType, TextConfig};
use serde_json::{Value, json};

use super::{BenchArgs, per_token_part};

/// The peer's runs: the script's JSON line each, in run order, the depths they ran at (deepest
/// first), and how the depth was chosen (for the report).
pub(super) struct PeerRuns {
    runs: Vec<Value>,
    depths: Vec<usize>,
    rule: String,
}

/// Runs the peer on the model `c` (its `config.json` at `config`) at the depths `--peer-layers`
/// gives, or by default at the deepest that fits `free` bytes of GPU memory ([`peer_fit`]), and half
/// that. Runs that fail are said so in `out` and left out.
pub(super) fn measure(
    args: &BenchArgs,
    c: &TextConfig,
    config: &std::path::Path,
    free: u64,
    out: &mut dyn Write,
) -> Result<PeerRuns> {
    let first_attention = c.layer_types.iter().position(|t| *t == LayerType::Attention).map_or(1, |i| i + 1);
    let (layers, rule) = match args.peer_layers {
        Some(n) => (n as usize, format!("`--peer-layers {n}`")),
        None => {
            let fit = peer_fit(c, free, first_attention, c.num_hidden_layers);
            let need = peer_bytes(c, fit);
            let fits = if peer_fits(c, fit, free) { "fits" } else { "does not fit (no depth does)" };
            let rule = format!(
                "the deepest multiple of {first_attention} layers, at most --layers, whose bf16 model (about {} at {fit} layers) fits the GPU's {} free with a tenth to spare; this one {fits}",
                format_bytes(need),
                format_bytes(free)
            );
            eprintln!("the transformers peer's depth: {rule}");
            (fit, rule)
        }
    };
    let depths = peer_depths(layers, c.num_hidden_layers, first_attention);
    Ok(PeerRuns { runs: run_peer(args, config, &depths, out)?, depths, rule })
}

impl PeerRuns {
    /// The report's paragraph on the peer and its JSON: its rates by depth, its 48-layer
    /// extrapolation, and Cherenkov's resident rate against it, at 48 layers (`ours_48`, both
    /// extrapolated) and at a depth both ran (`ours_depth`, `ours_tok_s`). None where no run
    /// reported.
    pub(super) fn report(&self, ours_48: f64, ours_depth: usize, ours_tok_s: f64) -> Option<(String, Value)> {
        let first = self.runs.first()?;
        let peer_all: Vec<(usize, f64)> = self
            .runs
            .iter()
            .filter_map(|r| Some((r["layers"].as_u64()? as usize, r["tokens_per_s"].as_f64()?)))
            .collect();
        let peer_rates = peer_best(&self.depths, &peer_all);
        let peer_48 = peer_at_depth(48, &peer_rates);
        let same_depth = peer_rates.iter().find(|(d, _)| *d == ours_depth).map(|&(_, tps)| ours_tok_s / tps);
        let list = |f: &dyn Fn(&(usize, f64)) -> String| peer_rates.iter().map(f).collect::<Vec<_>>().join(" and ");
        let mut md = format!(
            "\nPeer: {}, all on the GPU, on the same shape ({} experts) at {} layers: {} tok/s decode, each depth's faster run of two (the runs in order, layers: tok/s: {}; its depth: {}, and half that; its bf16 experts take about 5 GB a layer, so the 48-layer model does not fit the GPU; it ran first, alone on the GPU, timing as many tokens as the cases).",
            first["peer"].as_str().unwrap_or("transformers"),
            first["experts"],
            list(&|r| r.0.to_string()),
            list(&|r| format!("{:.2}", r.1)),
            peer_all.iter().map(|r| format!("{}: {:.2}", r.0, r.1)).collect::<Vec<_>>().join(", "),
            self.rule,
        );
        let line = peer_line(&peer_rates);
        if let (Some(p48), Some((fixed, layer))) = (peer_48, line) {
            md.push_str(&format!(
                " At 48 layers, by the same per-layer extrapolation as Cherenkov's figures ({fixed:.1} ms a token and {layer:.2} ms a layer from its two depths; a per-token part below zero counts as zero): {p48:.2} tok/s; Cherenkov with every expert resident ({ours_48:.1} tok/s at 48 layers) is {:.1}x that.",
                ours_48 / p48.max(1e-9)
            ));
        }
        if let Some(x) = same_depth {
            md.push_str(&format!(
                " At this run's depth ({ours_depth} layers) Cherenkov resident ({ours_tok_s:.1} tok/s) is {x:.1}x the peer."
            ));
        }
        md.push('\n');
        let v = json!({"runs": self.runs, "depth_rule": self.rule, "best": peer_rates.iter().map(|r| json!({"layers": r.0, "tokens_per_s": r.1})).collect::<Vec<_>>(),
               "tok_s_48_layers": peer_48,
               "per_token_ms": line.map(|l| l.0), "per_layer_ms": line.map(|l| l.1),
               "resident_ratio_48_layers": peer_48.map(|p| ours_48 / p), "resident_ratio_same_depth": same_depth});
        Some((md, v))
    }
}

/// The transformers peer's depths, deepest first: the lower of `peer_layers` and the model's
/// `layers`, and half of it where that is a depth of its own (the two points of its per-layer
/// extrapolation). Neither is shallower than `first_attention`, the depth that holds the first
/// attention layer: transformers' cache cannot tell its length from Gated DeltaNet layers alone
/// (`get_seq_length` fails at 2 layers of the released shape).
fn peer_depths(peer_layers: usize, layers: usize, first_attention: usize) -> Vec<usize> {
    let full = peer_layers.max(first_attention).min(layers).max(1);
    let half = (full / 2).max(first_attention);
    if half < full { vec![full, half] } else { vec![full] }
}

/// GPU memory the transformers peer holds at `depth` layers of `c` (its model in bf16, all on the
/// GPU): the tensors outside the decoder layers, the dense tensors, routed experts and n-gram
/// tables of its first `depth` layers, 2 bytes a parameter, and [`PEER_OVERHEAD`].
fn peer_bytes(c: &TextConfig, depth: usize) -> u64 {
    let held = |name: &str| match name.strip_prefix("layers.") {
        Some(rest) => rest.split('.').next().and_then(|i| i.parse::<usize>().ok()).is_some_and(|i| i < depth),
        None => true,
    };
    let dense: usize =
        arch::dense_specs(c, 0).iter().filter(|s| held(&s.name)).map(|s| s.shape.iter().product::<usize>()).sum();
    let expert: usize = arch::expert_shapes(c).iter().map(|s| s[0] * s[1]).sum();
    let ngram: u64 = (0..depth).filter_map(|i| arch::ngram_table_shape(c, i)).map(|(rows, w)| rows * w as u64).sum();
    2 * (dense as u64 + (expert * c.num_experts * depth) as u64 + ngram) + PEER_OVERHEAD
}

/// The peer's memory beyond its parameters: activations, its cache and the allocator's. Session 43
/// measured torch's `max_memory_allocated` at 22.79, 42.12, 61.45, 80.78 and 119.44 GiB at 4, 8,
/// 12, 16 and 24 layers of the released shape (the bench's n-gram rows), 0.07-0.12 GiB above their
/// parameters. What it does not count (CUDA's context, the allocator's cached blocks) is left to
/// [`peer_fits`]'s tenth.
const PEER_OVERHEAD: u64 = 128 << 20;

/// Whether the peer at `depth` layers of `c` fits `free` bytes of GPU memory: its [`peer_bytes`]
/// and a tenth more.
fn peer_fits(c: &TextConfig, depth: usize, free: u64) -> bool {
    peer_bytes(c, depth) as f64 * 1.1 <= free as f64
}

/// The peer's default depth: the deepest multiple of `period` (the attention layers' spacing, so
/// that the deeper depth holds whole groups of layers) at most `layers` that [`peer_fits`] `free`
/// bytes of GPU memory; `period` where none fits (its runs may then fail, and the report says so).
fn peer_fit(c: &TextConfig, free: u64, period: usize, layers: usize) -> usize {
    let period = period.max(1);
    (1..=layers / period).map(|n| n * period).take_while(|&d| peer_fits(c, d, free)).last().unwrap_or(period)
}

/// The order the peer runs in: each of `depths` twice, deepest first and then in reverse (8, 4, 4,
/// 8), so that neither depth always runs first. Single runs of the peer moved by up to 20% in
/// session 41 (at 8 layers alone on the GPU: 29.6 and 35.4 tok/s in one call).
fn peer_order(depths: &[usize]) -> Vec<usize> {
    depths.iter().chain(depths.iter().rev()).copied().collect()
}

/// The peer's rate at each of `depths` (deepest first) from its `runs` (`(layers, tok/s)`): the
/// faster run at that depth, the measurement least slowed by anything beside it, which favours the
/// peer. Depths without a run are left out.
fn peer_best(depths: &[usize], runs: &[(usize, f64)]) -> Vec<(usize, f64)> {
    depths
        .iter()
        .filter_map(|&d| runs.iter().filter(|r| r.0 == d).map(|r| r.1).reduce(f64::max).map(|tps| (d, tps)))
        .collect()
}

/// The peer's step as Cherenkov's 48-layer figures model one, from its runs at two depths
/// (`(layers, tok/s)`, deepest first): a per-token part and a part per layer, in ms. None without
/// two usable runs at different depths.
fn peer_line(runs: &[(usize, f64)]) -> Option<(f64, f64)> {
    let [(deep, deep_tps), (shallow, shallow_tps)] = *runs else { return None };
    if deep == shallow || deep_tps <= 0.0 || shallow_tps <= 0.0 {
        return None;
    }
    let (deep_ms, shallow_ms) = (1e3 / deep_tps, 1e3 / shallow_tps);
    let fixed = per_token_part(deep_ms, deep, shallow_ms, shallow);
    Some((fixed, (deep_ms - fixed).max(0.0) / deep as f64))
}

/// The peer's rate at `target` layers by [`peer_line`].
fn peer_at_depth(target: usize, runs: &[(usize, f64)]) -> Option<f64> {
    peer_line(runs).map(|(fixed, layer)| 1e3 / (fixed + target as f64 * layer))
}

/// Runs `tools/bench/hf_peer.py` on `config` at each of `depths` in turn ([`peer_order`]); returns
/// the runs that reported (the script's JSON line each, in run order), saying in `out` which failed
/// and why.
fn run_peer(
    args: &BenchArgs,
    config: &std::path::Path,
    depths: &[usize],
    out: &mut dyn Write,
) -> Result<Vec<serde_json::Value>> {
    let mut runs = Vec::new();
    for depth in peer_order(depths) {
        eprintln!("timing the transformers peer at {depth} layers");
        let o = std::process::Command::new(&args.python)
            .args(["tools/bench/hf_peer.py", "--config"])
            .arg(config)
            .args(["--tokens", &args.tokens.to_string(), "--layers", &depth.to_string()])
            .output()
            .with_context(|| format!("running {} tools/bench/hf_peer.py", args.python))?;
        let text = String::from_utf8_lossy(&o.stdout);
        match text.lines().rev().find(|l| l.starts_with('{')).and_then(|l| serde_json::from_str(l).ok()) {
            Some(v) => runs.push(v),
            None => writeln!(
                out,
                "peer failed at {depth} layers: {}",
                String::from_utf8_lossy(&o.stderr).lines().rev().take(5).collect::<Vec<_>>().join(" | ")
            )?,
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cherenkov_model::config::ModelConfig;
    use cherenkov_model::synth::SynthShape;

    const GIB: f64 = (1u64 << 30) as f64;

    /// The bench's model at 32 layers of the released shape (its n-gram rows), as session 43 ran it.
    fn bench_config() -> TextConfig {
        let shape = SynthShape {
            num_hidden_layers: 32,
            num_experts: 512,
            ngram_vocab_size_base: 200_003,
            ..SynthShape::flash()
        };
        ModelConfig::from_value(&shape.config_json()).unwrap().text
    }

    #[test]
    fn the_peer_memory_estimate_matches_what_the_peer_held() {
        // torch's max_memory_allocated in session 43's runs (bench-2026-12-03-s43-*.json).
        let c = bench_config();
        for (depth, held) in [(4, 22.79), (8, 42.12), (12, 61.45), (16, 80.78), (24, 119.44)] {
            let est = peer_bytes(&c, depth) as f64 / GIB;
            eprintln!("{depth} layers: {est:.2} GiB estimated, {held} held");
            assert!((est - held).abs() / held < 0.01, "{depth} layers: {est:.2} GiB estimated, {held} held");
        }
    }

    #[test]
    fn the_peer_runs_as_deep_as_fits_the_gpu() {
        let c = bench_config();
        // An H200 (139.3 GiB free), an 80 GB card, and one that holds no depth at all.
        assert_eq!(peer_fit(&c, (139.3 * GIB) as u64, 4, 32), 24);
        assert_eq!(peer_fit(&c, (79.0 * GIB) as u64, 4, 32), 12);
        assert_eq!(peer_fit(&c, (139.3 * GIB) as u64, 4, 16), 16);
        assert_eq!(peer_fit(&c, (10.0 * GIB) as u64, 4, 32), 4);
        assert_eq!(peer_depths(peer_fit(&c, (139.3 * GIB) as u64, 4, 32), 32, 4), vec![24, 12]);
    }

    #[test]
    fn the_peer_runs_at_the_depths_that_fit_and_extrapolates_like_cherenkov() {
        // No deeper than --peer-layers or the store, and at half that for the extrapolation.
        assert_eq!(peer_depths(8, 32, 4), vec![8, 4]);
        assert_eq!(peer_depths(5, 32, 1), vec![5, 2]);
        assert_eq!(peer_depths(8, 1, 1), vec![1]);
        // Never shallower than the first attention layer (layer 4 of the released shape).
        assert_eq!(peer_depths(8, 4, 4), vec![4]);
        assert_eq!(peer_depths(6, 32, 4), vec![6, 4]);
        assert_eq!(peer_depths(2, 32, 4), vec![4]);
        // 12 ms per token plus 3 ms per layer (an eager peer's host time grows with depth too).
        let tps = |layers: usize| 1e3 / (12.0 + 3.0 * layers as f64);
        let at48 = peer_at_depth(48, &[(8, tps(8)), (4, tps(4))]).unwrap();
        assert!((at48 - tps(48)).abs() < 1e-9, "{at48} against {}", tps(48));
        let (fixed, layer) = peer_line(&[(8, tps(8)), (4, tps(4))]).unwrap();
        assert!((fixed - 12.0).abs() < 1e-9 && (layer - 3.0).abs() < 1e-9, "{fixed} {layer}");
        // A step that grows faster than its depth (session 40's peer: 40.5 ms at 8 layers, 14.7 at
        // 4) meets zero layers below zero: every millisecond then counts per layer.
        let (fixed, layer) = peer_line(&[(8, 1e3 / 40.5), (4, 1e3 / 14.7)]).unwrap();
        assert!(fixed == 0.0 && (layer - 40.5 / 8.0).abs() < 1e-9, "{fixed} {layer}");
        // One run, two runs at one depth, or a run that reported nothing: no extrapolation.
        assert_eq!(peer_at_depth(48, &[(8, tps(8))]), None);
        assert_eq!(peer_at_depth(48, &[(4, tps(4)), (4, tps(4))]), None);
        assert_eq!(peer_at_depth(48, &[(8, tps(8)), (4, 0.0)]), None);
    }

    #[test]
    fn the_peer_runs_each_depth_twice_in_turn_and_keeps_its_faster_run() {
        assert_eq!(peer_order(&[8, 4]), vec![8, 4, 4, 8]);
        assert_eq!(peer_order(&[4]), vec![4, 4]);
        // Session 41's runs alone on the GPU, in that order.
        let runs = [(8, 29.62), (4, 57.29), (4, 59.85), (8, 35.37)];
        assert_eq!(peer_best(&[8, 4], &runs), vec![(8, 35.37), (4, 59.85)]);
        // A depth whose runs all failed is left out, so there is no extrapolation.
        assert_eq!(peer_best(&[8, 4], &[(8, 29.62), (8, 35.37)]), vec![(8, 35.37)]);
        assert_eq!(peer_at_depth(48, &peer_best(&[8, 4], &[(8, 29.62), (8, 35.37)])), None);
    }

    #[test]
    fn the_report_extrapolates_the_faster_runs_and_says_how_the_depth_was_chosen() {
        // Session 43's call 3 (bench-2026-12-03-s43-32L.json), with Cherenkov at 279.0 tok/s at 48
        // layers and 407.1 at 32.
        let run = |layers: u64, tps: f64| json!({"peer": "transformers 5.17.0", "experts": 512, "layers": layers, "tokens_per_s": tps});
        let runs = vec![run(24, 9.34), run(12, 26.21), run(12, 22.55), run(24, 13.33)];
        let peer = PeerRuns { runs, depths: vec![24, 12], rule: "the deepest that fits".into() };
        let (md, v) = peer.report(279.0, 32, 407.1).unwrap();
        assert!(md.contains("at 24 and 12 layers: 13.33 and 26.21 tok/s"), "{md}");
        assert!(md.contains("its depth: the deepest that fits, and half that"), "{md}");
        assert!(md.contains("6.72 tok/s") && md.contains("41.5x that"), "{md}");
        // No depth of the peer is the run's own, so there is no same-depth ratio.
        assert!(!md.contains("At this run's depth"), "{md}");
        assert!((v["tok_s_48_layers"].as_f64().unwrap() - 6.72).abs() < 5e-3, "{v}");
        assert_eq!(v["best"][0]["layers"], 24);
        assert_eq!(v["depth_rule"], "the deepest that fits");
        assert!(v["resident_ratio_same_depth"].is_null());
        // At a depth both ran, the ratio there too.
        let (md, v) = peer.report(279.0, 24, 300.0).unwrap();
        assert!(
            md.contains("At this run's depth (24 layers) Cherenkov resident (300.0 tok/s) is 22.5x the peer."),
            "{md}"
        );
        assert!((v["resident_ratio_same_depth"].as_f64().unwrap() - 300.0 / 13.33).abs() < 1e-9);
        // Every run failed: nothing to report.
        assert!(
            PeerRuns { runs: Vec::new(), depths: vec![24, 12], rule: String::new() }.report(279.0, 32, 407.1).is_none()
        );
    }
}
