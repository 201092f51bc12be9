//! Speculative decoding through the engine's decode loop on the CPU backend: the tokens are those
//! of decoding without drafts, for greedy and sampled decoding, whether the drafts are rejected
//! (the tiny fixture's random MTP head) or accepted (an oracle that drafts the trunk's own choice).

mod common;
#[path = "support/oracle.rs"]
mod oracle;

use cherenkov_engine::backend::Backend;
use cherenkov_engine::generate::{GenerateOptions, Generation, generate};
use cherenkov_engine::sampling::SamplingParams;
use cherenkov_engine::tokenizer::Tokenizer;
use common::{model, store};
use oracle::Oracle;

fn run<B: Backend>(b: &B, prompt: &[u32], tok: &Tokenizer, sampling: &SamplingParams, draft: usize) -> Generation {
    let opts = GenerateOptions {
        max_tokens: 20,
        sampling: sampling.clone(),
        stop_tokens: vec![],
        stop_strings: vec![],
        draft,
    };
    let mut s = b.new_session().unwrap();
    generate(b, &mut s, prompt, tok, &opts, &mut |_| true).unwrap()
}

fn samplings() -> Vec<SamplingParams> {
    let sampled =
        |temperature, top_k, seed| SamplingParams { temperature, top_k, seed: Some(seed), ..SamplingParams::default() };
    vec![SamplingParams::greedy(), sampled(1.0, 0, 7), sampled(0.7, 5, 11)]
}

#[test]
fn drafted_decoding_gives_the_tokens_of_plain_decoding() {
    let st = store("tiny-a/mlx4");
    let tok = Tokenizer::from_dir(&st.dir).unwrap();
    let m = model(st, 64);
    let prompt = tok.encode("The quick brown fox jumps", false).unwrap();
    for sampling in samplings() {
        let plain = run(&m, &prompt, &tok, &sampling, 0);
        assert_eq!(plain.tokens.len(), 20);
        assert_eq!(plain.timing.drafted, 0);
        for (name, g) in [
            ("MTP head", run(&m, &prompt, &tok, &sampling, 1)),
            ("oracle", run(&Oracle(&m), &prompt, &tok, &sampling, 1)),
        ] {
            assert_eq!(g.tokens, plain.tokens, "{name}, {sampling:?}");
            assert_eq!(g.text, plain.text, "{name}, {sampling:?}");
            let t = &g.timing;
            assert_eq!(t.decode_tokens, 19, "{name}");
            // A step verifies one draft; an accepted draft gives the next token without a step
            // (except the last token's, which generation does not forward).
            assert_eq!(t.drafted, t.decode_steps, "{name}");
            let given = t.decode_steps + t.accepted;
            assert!(given == t.decode_tokens || given == t.decode_tokens + 1, "{name}: {t:?}");
        }
        let oracle = run(&Oracle(&m), &prompt, &tok, &sampling, 1);
        if sampling.temperature == 0.0 {
            assert_eq!(oracle.timing.accepted, oracle.timing.drafted, "greedy oracle drafts are all accepted");
            assert!(oracle.timing.decode_steps <= 10, "{:?}", oracle.timing);
        }
    }
}

#[test]
fn drafting_needs_a_model_with_an_mtp_head() {
    let st = store("tiny-b/mlx4");
    let tok = Tokenizer::from_dir(&st.dir).unwrap();
    let m = model(st, 64);
    let opts = GenerateOptions {
        max_tokens: 4,
        sampling: SamplingParams::greedy(),
        stop_tokens: vec![],
        stop_strings: vec![],
        draft: 1,
    };
    let e = generate(&m, &mut m.new_session(), &[1, 2], &tok, &opts, &mut |_| true).unwrap_err().to_string();
    assert!(e.contains("no MTP head"), "{e}");
}

#[test]
fn the_drafts_and_verifying_rows_candidates_are_the_top_of_their_logits() {
    use cherenkov_engine::backend::top_of;
    let st = store("tiny-a/mlx4");
    let m = model(st, 64);
    let vocab = m.vocab_size();
    let among = vocab - 7;
    let (mut a, mut b) = (m.new_session(), m.new_session());
    for s in [&mut a, &mut b] {
        m.enable_drafting(s).unwrap();
        m.forward(s, &[3, 1, 4, 1, 5], cherenkov_engine::backend::Logits::Last).unwrap();
    }
    // The same calls on two equal sessions: the full logits on one, the candidates on the other.
    let draft = m.draft(&mut a, 9).unwrap();
    let top = Backend::draft_top(&m, &mut b, 9, 5, among).unwrap();
    assert_eq!(top, top_of(&draft[..among], 5));
    let rows = m.verify(&mut a, &[9, 2]).unwrap();
    let tops = Backend::verify_top(&m, &mut b, &[9, 2], 5, among).unwrap();
    assert_eq!(tops.len(), 2);
    for (r, t) in tops.iter().enumerate() {
        assert_eq!(t, &top_of(&rows[r * vocab..r * vocab + among], 5), "row {r}");
        assert!(t.iter().all(|&(i, _)| (i as usize) < among));
    }
}
