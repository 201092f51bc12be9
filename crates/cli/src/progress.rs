//! Progress bars on stderr, hidden when stderr is not a terminal (pipes, logs, tests).

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar counting bytes, with throughput and ETA. Its message names the current phase.
pub fn bytes_bar(message: &'static str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{msg:>14} [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} ({elapsed})",
    )
    .expect("the template is valid")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(message);
    bar
}
