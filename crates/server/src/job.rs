//! What an HTTP handler hands to the inference thread (a [`Job`]) and what comes back ([`Event`]s).
//!
//! A job is fully validated and tokenized before it is queued: the inference thread only runs
//! forwards, samples and reports. Events travel over an unbounded channel so that a slow client never
//! blocks the thread that serves everyone; a job produces at most `max_tokens` of them. The thread
//! notices a dropped receiver (the client went away) before each step and ends the job there.

use std::time::Instant;

use cherenkov_engine::sampling::SamplingParams;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;

/// How one request generates.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// Most tokens to generate (0: only process the prompt).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Added to the logits of these tokens before sampling (OpenAI `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Token ids that end generation without being part of the output (EOS).
    pub stop_tokens: Vec<u32>,
    /// Token sequences that end generation; the sequence is not part of the output.
    pub stop_sequences: Vec<Vec<u32>>,
    /// Strings that end generation; the text stops before the first occurrence.
    pub stop_strings: Vec<String>,
    /// Report each generated token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Report each prompt token's log-probability and this many alternatives (`echo`); the prompt
    /// then runs from the start with `Logits::All`, whatever the prefix cache holds.
    pub prompt_logprobs: Option<usize>,
}

/// A request ready to run.
#[derive(Debug)]
pub struct Job {
    /// The response id (`chatcmpl-...`), for the log.
    pub id: String,
    pub prompt: Vec<u32>,
    /// Prompt positions, besides the end, worth a snapshot: for chat, where the conversation so far
    /// ends and the generation prompt begins (the next turn repeats everything before it).
    pub snapshot_at: Vec<usize>,
    pub params: GenParams,
    /// A retained session to continue and to store the final state in.
    pub session_id: Option<String>,
    pub deadline: Instant,
    /// The timeout the deadline came from, for the error message.
    pub timeout_secs: u64,
    pub events: UnboundedSender<Event>,
}

/// One token's log-probability and the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    /// `None` for the first prompt token (nothing predicts it).
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

/// A generated token as reported to the client.
#[derive(Clone, Debug, PartialEq)]
pub struct GenToken {
    pub id: u32,
    /// Characters of generated text before this token's text.
    pub text_offset: usize,
    /// Present when the request asked for logprobs.
    pub logprob: Option<TokenLogprob>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens restored from the prefix cache or a retained session instead of computed.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

#[derive(Debug)]
pub enum Event {
    /// The prompt is processed (sent once, before any text).
    Prompt {
        cached_tokens: usize,
        logprobs: Option<Vec<TokenLogprob>>,
    },
    /// Final text and the tokens it came from (tokens whose text is held back arrive later).
    Text {
        text: String,
        tokens: Vec<GenToken>,
    },
    Done {
        finish: Finish,
        usage: Usage,
    },
    /// The job ended without an answer (timeout, backend failure).
    Error(ApiError),
}
