//! `cherenkov dash`: a terminal dashboard of a running server, refreshed about once a second.
//!
//! A fetch thread reads the server's JSON statistics (`/v1/stats/summary`, and `/v1/stats/layers`
//! or one layer's `/experts`, whichever the screen shows) and hands them to the UI thread, which
//! draws and handles keys; so a slow or dead server never freezes the keys. When the server stops
//! answering, the screen says "waiting for the server at URL" and the fetch thread keeps trying
//! every interval; a restarted server (or another one at the same address) is picked up as soon as
//! it answers. Nothing here knows the model: it only reads the documents of `docs/stats.md`.
//!
//! Keys: Up/Down (or k/j) select a row, PageUp/PageDown page, Home/End, Enter opens the selected
//! layer's experts, Escape (or Backspace) returns to the layers, q (or Ctrl-C) quits.

use std::io::{IsTerminal, Write};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Sparkline, Table, TableState, Wrap};
use serde_json::Value;

use crate::client::{Client, ServerArgs};
use crate::stats::{
    EXPERT_COLUMNS, LAYER_COLUMNS, bounds, bytes, dur, expert_cells, float, int, layer_cells, n, pct, rows, split_text,
    uptime,
};

#[derive(clap::Args, Debug)]
pub struct DashArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0, value_name = "SECS")]
    pub interval: f64,
}

/// What the table shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    Layers,
    /// The experts of this MoE layer.
    Experts(usize),
}

/// What the fetch thread sends.
pub enum Fetched {
    /// The summary and the table document of `view`.
    Data { summary: Value, table: Value, view: View },
    /// No answer (or an error answer); the reason.
    Down(String),
}

enum Conn {
    Connecting,
    Up,
    Down(String),
}

pub struct Dash {
    url: String,
    pub view: View,
    conn: Conn,
    summary: Option<Value>,
    layers: Option<Value>,
    experts: Option<Value>,
    layer_state: TableState,
    expert_state: TableState,
    /// Rows the table showed last time it was drawn (a page).
    page: usize,
    updated: Option<Instant>,
    started_unix: Option<f64>,
}

impl Dash {
    pub fn new(url: &str) -> Dash {
        Dash {
            url: url.to_string(),
            view: View::Layers,
            conn: Conn::Connecting,
            summary: None,
            layers: None,
            experts: None,
            layer_state: TableState::default().with_selected(0),
            expert_state: TableState::default().with_selected(0),
            page: 10,
            updated: None,
            started_unix: None,
        }
    }

    pub fn apply(&mut self, f: Fetched) {
        match f {
            Fetched::Down(why) => self.conn = Conn::Down(why),
            Fetched::Data { summary, table, view } => {
                self.conn = Conn::Up;
                let started = summary.get("server").and_then(|s| float(s, "started_unix"));
                if self.started_unix.is_some() && started != self.started_unix {
                    // Another server (a restart): its layers may differ.
                    self.experts = None;
                }
                self.started_unix = started;
                self.summary = Some(summary);
                match view {
                    View::Layers => self.layers = Some(table),
                    View::Experts(_) => self.experts = Some(table),
                }
                self.updated = Some(Instant::now());
                self.clamp();
            }
        }
    }

    fn rows_of(&self, view: View) -> usize {
        match view {
            View::Layers => self.layers.as_ref().map_or(0, |d| rows(d, "layers").len()),
            View::Experts(_) => self.experts.as_ref().map_or(0, |d| rows(d, "experts").len()),
        }
    }

    fn state(&mut self) -> &mut TableState {
        match self.view {
            View::Layers => &mut self.layer_state,
            View::Experts(_) => &mut self.expert_state,
        }
    }

    fn clamp(&mut self) {
        for view in [View::Layers, View::Experts(0)] {
            let n = self.rows_of(view);
            let st = if view == View::Layers { &mut self.layer_state } else { &mut self.expert_state };
            let sel = st.selected().unwrap_or(0).min(n.saturating_sub(1));
            st.select(Some(sel));
        }
    }

    fn move_by(&mut self, delta: isize) {
        let n = self.rows_of(self.view);
        let st = self.state();
        let cur = st.selected().unwrap_or(0) as isize;
        let next = (cur + delta).clamp(0, n.saturating_sub(1) as isize);
        st.select(Some(next as usize));
    }

    /// Handles a key; returns false to quit. Entering or leaving a layer changes `view`.
    pub fn key(&mut self, code: KeyCode, mods: KeyModifiers) -> bool {
        let page = self.page.max(1) as isize;
        match code {
            KeyCode::Char('q') | KeyCode::Char('Q') => return false,
            KeyCode::Char('c') if mods.contains(KeyModifiers::CONTROL) => return false,
            KeyCode::Up | KeyCode::Char('k') => self.move_by(-1),
            KeyCode::Down | KeyCode::Char('j') => self.move_by(1),
            KeyCode::PageUp => self.move_by(-page),
            KeyCode::PageDown => self.move_by(page),
            KeyCode::Home => self.move_by(isize::MIN / 2),
            KeyCode::End => self.move_by(isize::MAX / 2),
            KeyCode::Enter if self.view == View::Layers => {
                let sel = self.layer_state.selected().unwrap_or(0);
                let layer = self.layers.as_ref().and_then(|d| rows(d, "layers").get(sel)).and_then(|r| int(r, "layer"));
                if let Some(l) = layer {
                    self.view = View::Experts(l as usize);
                    if self.experts.as_ref().and_then(|d| int(d, "layer")) != Some(l) {
                        self.experts = None;
                        self.expert_state.select(Some(0));
                    }
                }
            }
            KeyCode::Esc | KeyCode::Backspace | KeyCode::Left => self.view = View::Layers,
            _ => {}
        }
        true
    }

    pub fn render(&mut self, f: &mut Frame) {
        let [title, summary, spark, table, help] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(3),
            Constraint::Length(4),
            Constraint::Min(4),
            Constraint::Length(1),
        ])
        .areas(f.area());
        f.render_widget(Paragraph::new(self.title_line()), title);
        if let Conn::Up = self.conn {
        } else {
            let (head, why) = match &self.conn {
                Conn::Connecting => (format!("connecting to the server at {}", self.url), String::new()),
                Conn::Down(why) => (format!("waiting for the server at {}", self.url), why.clone()),
                Conn::Up => unreachable!(),
            };
            let text = vec![
                Line::from(Span::styled(head, Style::default().fg(Color::Yellow).add_modifier(Modifier::BOLD))),
                Line::from(why),
                Line::from("retrying every interval; start it with `cherenkov serve --model NAME`, or pass --url"),
            ];
            let area = Rect { height: summary.height + spark.height + table.height, ..summary };
            f.render_widget(Paragraph::new(text).wrap(Wrap { trim: false }), area);
            f.render_widget(Paragraph::new(self.help_line()), help);
            return;
        }
        f.render_widget(Paragraph::new(self.summary_lines()), summary);
        self.render_sparkline(f, spark);
        self.render_table(f, table);
        f.render_widget(Paragraph::new(self.help_line()), help);
    }

    fn title_line(&self) -> Line<'static> {
        let server = self.summary.as_ref().and_then(|s| s.get("server"));
        let mut spans = vec![
            Span::styled("cherenkov dash", Style::default().add_modifier(Modifier::BOLD)),
            Span::raw(format!("  {}", self.url)),
        ];
        if let (Some(s), Conn::Up) = (server, &self.conn) {
            let models: Vec<&str> = s
                .get("models")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            spans.push(Span::raw(format!(
                "  {} backend, serving {}, up {}",
                s.get("backend").and_then(Value::as_str).unwrap_or("?"),
                models.join(", "),
                float(s, "uptime_seconds").map_or_else(|| "-".into(), uptime)
            )));
        }
        Line::from(spans)
    }

    fn summary_lines(&self) -> Vec<Line<'static>> {
        let null = Value::Null;
        let s = self.summary.as_ref().unwrap_or(&null);
        let get = |v: &Value, k: &str| v.get(k).cloned().unwrap_or(Value::Null);
        let (steps, ec, req, pc) =
            (get(s, "steps"), get(s, "expert_cache"), get(s, "requests"), get(s, "prefix_cache"));
        let total = get(&ec, "total");
        let decode = get(&steps, "decode");
        let tps = s.get("throughput").and_then(|t| float(t, "tokens_per_second")).unwrap_or(0.0);
        let rate = |v: &Value, k: &str| float(v, k).map_or_else(|| "-".into(), |r| format!("{r:.1}"));
        let line1 = format!(
            "{tps:.0} tok/s now | decode {} tok/s (last 32 steps {}) | {} active, {} queued, {} done | prefix cache {} of {} hit",
            rate(&decode, "tokens_per_second"),
            rate(&decode, "recent_tokens_per_second"),
            n(&req, "active"),
            n(&req, "queued"),
            n(&req, "completed"),
            n(&pc, "hits"),
            n(&pc, "lookups"),
        );
        // Misses computed on the CPU (`--cpu-experts`), only when there are any.
        let cpu = match total.get("cpu_computed").and_then(Value::as_u64) {
            Some(c) if c > 0 => format!(" | {c} computed on the CPU"),
            _ => String::new(),
        };
        let line2 = format!(
            "experts: hit {} of {} routed | {} reads, {} | read mean {} | waited {} | {} evictions | lookahead {}{cpu}",
            pct(float(&total, "hit_rate")),
            n(&total, "routed"),
            n(&total, "reads"),
            bytes(&total, "bytes_read"),
            dur(float(&total, "mean_read_ns")),
            dur(float(&total, "wait_ns")),
            n(&total, "evictions"),
            pct(float(&total, "lookahead_accuracy")),
        );
        let split = match s.get("time_split").filter(|v| !v.is_null()) {
            Some(ts) => format!("time: {}", split_text(ts)),
            None => "time: not measured by this backend".into(),
        };
        let mtp = if s.get("mtp").is_none_or(Value::is_null) { "MTP: absent" } else { "MTP: see stats summary" };
        vec![Line::from(line1), Line::from(line2), Line::from(format!("{split} | {mtp}"))]
    }

    fn render_sparkline(&self, f: &mut Frame, area: Rect) {
        let series: Vec<u64> = self
            .summary
            .as_ref()
            .and_then(|s| s.get("throughput"))
            .and_then(|t| t.get("generated_tokens"))
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let width = area.width.saturating_sub(2) as usize;
        let shown = &series[series.len().saturating_sub(width)..];
        let max = shown.iter().copied().max().unwrap_or(0);
        let block = Block::default()
            .borders(Borders::ALL)
            .title(format!(" generated tokens/s, last {} s (max {max}) ", shown.len()));
        f.render_widget(Sparkline::default().block(block).data(shown.to_vec()).max(max.max(1)), area);
    }

    fn render_table(&mut self, f: &mut Frame, area: Rect) {
        let hl = Style::default().add_modifier(Modifier::REVERSED);
        let header_style = Style::default().add_modifier(Modifier::BOLD);
        // Borders and the header take three rows.
        self.page = area.height.saturating_sub(3) as usize;
        match self.view {
            View::Layers => {
                let Some(doc) = &self.layers else {
                    f.render_widget(Paragraph::new("loading layers..."), area);
                    return;
                };
                let b = bounds(doc);
                // The name (`layers.3`) and precision columns are left out: the table must fit.
                let keep = [0usize, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14];
                let body: Vec<Row> = rows(doc, "layers")
                    .iter()
                    .map(|r| {
                        let c = layer_cells(r, &b);
                        right_aligned(keep.iter().map(|&i| c[i].clone()).collect(), 1)
                    })
                    .collect();
                let header =
                    right_aligned(keep.iter().map(|&i| LAYER_COLUMNS[i].to_string()).collect(), 1).style(header_style);
                let widths = [5, 8, 6, 7, 6, 9, 9, 8, 9, 9, 9, 8, 9].map(Constraint::Length);
                let title = format!(
                    " MoE layers ({}; {} experts each) - Enter: experts of the selected layer ",
                    rows(doc, "layers").len(),
                    n(doc, "experts_per_layer")
                );
                let t = Table::new(body, widths)
                    .header(header)
                    .block(Block::default().borders(Borders::ALL).title(title))
                    .row_highlight_style(hl)
                    .highlight_symbol("> ");
                f.render_stateful_widget(t, area, &mut self.layer_state);
            }
            View::Experts(layer) => {
                let doc = self.experts.as_ref().filter(|d| int(d, "layer") == Some(layer as u64));
                let Some(doc) = doc else {
                    f.render_widget(Paragraph::new(format!("loading the experts of layer {layer}...")), area);
                    return;
                };
                let body: Vec<Row> = rows(doc, "experts").iter().map(|r| right_aligned(expert_cells(r), 2)).collect();
                let header =
                    right_aligned(EXPERT_COLUMNS.iter().map(|s| s.to_string()).collect(), 2).style(header_style);
                let widths = [6, 9, 8, 7, 8, 7, 7, 7, 10, 9, 10].map(Constraint::Length);
                let title = format!(
                    " experts of layer {layer} ({}, {}), {} resident - Esc: back to the layers ",
                    doc.get("name").and_then(Value::as_str).unwrap_or("?"),
                    doc.get("precision").and_then(Value::as_str).unwrap_or("?"),
                    n(doc, "resident")
                );
                let t = Table::new(body, widths)
                    .header(header)
                    .block(Block::default().borders(Borders::ALL).title(title))
                    .row_highlight_style(hl)
                    .highlight_symbol("> ");
                f.render_stateful_widget(t, area, &mut self.expert_state);
            }
        }
    }

    fn help_line(&self) -> Line<'static> {
        let age =
            self.updated.map_or_else(String::new, |t| format!("  updated {:.1} s ago", t.elapsed().as_secs_f64()));
        let keys = match self.view {
            View::Layers => "Up/Down select  PgUp/PgDn page  Enter experts  q quit",
            View::Experts(_) => "Up/Down select  PgUp/PgDn page  Esc back  q quit",
        };
        Line::from(vec![Span::styled(keys, Style::default().fg(Color::Cyan)), Span::raw(age)])
    }
}

/// A table row whose cells after the first `left` are right-aligned (numbers).
fn right_aligned(cells: Vec<String>, left: usize) -> Row<'static> {
    Row::new(cells.into_iter().enumerate().map(|(i, c)| {
        let line = Line::from(c);
        Cell::from(if i < left { line } else { line.alignment(Alignment::Right) })
    }))
}

/// Fetches what `view` shows, every `interval` or at once when woken; ends when the UI goes.
fn fetch_loop(client: Client, view: Arc<Mutex<View>>, wake: Receiver<()>, out: Sender<Fetched>, interval: Duration) {
    loop {
        let v = *view.lock().unwrap_or_else(|e| e.into_inner());
        let path = match v {
            View::Layers => "/v1/stats/layers".to_string(),
            View::Experts(l) => format!("/v1/stats/layers/{l}/experts"),
        };
        let got = client.get_json("/v1/stats/summary").and_then(|s| client.get_json(&path).map(|t| (s, t)));
        let msg = match got {
            Ok((summary, table)) => Fetched::Data { summary, table, view: v },
            Err(e) => Fetched::Down(client.explain(&e)),
        };
        if out.send(msg).is_err() {
            return;
        }
        match wake.recv_timeout(interval) {
            Ok(()) | Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

pub fn run(args: &DashArgs, _out: &mut dyn Write) -> Result<()> {
    if !(args.interval > 0.0 && args.interval <= 3600.0) {
        bail!("--interval {} must be more than 0 and at most 3600 seconds", args.interval);
    }
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        bail!("cherenkov dash draws on a terminal; for scripts use `cherenkov stats summary|layers|experts --json`");
    }
    let client = Client::new(&args.server)?;
    let mut dash = Dash::new(&client.url);
    let view = Arc::new(Mutex::new(View::Layers));
    let (wake_tx, wake_rx) = channel();
    let (data_tx, data_rx) = channel();
    let interval = Duration::from_secs_f64(args.interval);
    {
        let view = view.clone();
        std::thread::Builder::new()
            .name("cherenkov-dash-fetch".into())
            .spawn(move || fetch_loop(client, view, wake_rx, data_tx, interval))
            .context("cannot start the fetch thread")?;
    }
    let mut terminal = ratatui::try_init().context("cannot set up the terminal")?;
    let result = (|| -> Result<()> {
        loop {
            while let Ok(f) = data_rx.try_recv() {
                dash.apply(f);
            }
            terminal.draw(|f| dash.render(f))?;
            if !event::poll(Duration::from_millis(100))? {
                continue;
            }
            if let Event::Key(k) = event::read()?
                && k.kind == KeyEventKind::Press
            {
                let before = dash.view;
                if !dash.key(k.code, k.modifiers) {
                    return Ok(());
                }
                if dash.view != before {
                    *view.lock().unwrap_or_else(|e| e.into_inner()) = dash.view;
                    let _ = wake_tx.send(());
                }
            }
        }
    })();
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;
    use serde_json::json;

    fn screen(dash: &mut Dash) -> String {
        let mut t = Terminal::new(TestBackend::new(140, 30)).unwrap();
        t.draw(|f| dash.render(f)).unwrap();
        let buf = t.backend().buffer();
        (0..buf.area.height)
            .map(|y| (0..buf.area.width).map(|x| buf[(x, y)].symbol().to_string()).collect::<String>() + "\n")
            .collect()
    }

    fn layer(l: u64, hits: u64) -> Value {
        json!({"layer": l, "name": format!("layers.{l}"), "precision": "q4g64", "routed": 10, "hits": hits,
               "hit_rate": hits as f64 / 10.0, "reads": 3, "bytes_read": 3 * 24576, "latency": [3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]})
    }

    fn data(view: View) -> Fetched {
        let summary = json!({"server": {"backend": "cpu", "models": ["cherenkov"], "uptime_seconds": 5.0, "started_unix": 1.0},
            "throughput": {"generated_tokens": [0, 3, 5], "tokens_per_second": 5.0},
            "expert_cache": {"total": {"hit_rate": 0.5, "routed": 20}}, "mtp": null});
        let table = match view {
            View::Layers => {
                json!({"layers": [layer(0, 7), layer(1, 4)], "latency_bounds_us": [50], "experts_per_layer": 6})
            }
            View::Experts(l) => json!({"layer": l, "name": format!("layers.{l}"), "precision": "q4g64", "resident": 1,
                "experts": [{"expert": 0, "state": "resident", "routed": 4}, {"expert": 1, "state": "absent", "routed": 0}]}),
        };
        Fetched::Data { summary, table, view }
    }

    #[test]
    fn misses_computed_on_the_cpu_show_only_when_there_are_some() {
        let text = |cpu: u64| {
            let mut d = Dash::new("http://127.0.0.1:1");
            d.summary = Some(json!({"expert_cache": {"total": {"hit_rate": 0.5, "routed": 20, "cpu_computed": cpu}}}));
            d.summary_lines().iter().map(|l| l.to_string()).collect::<Vec<_>>().join("\n")
        };
        assert!(text(3).contains("| 3 computed on the CPU"), "{}", text(3));
        assert!(!text(0).contains("CPU"), "{}", text(0));
    }

    #[test]
    fn navigates_layers_and_experts() {
        let mut d = Dash::new("http://127.0.0.1:1");
        assert!(screen(&mut d).contains("connecting to the server at http://127.0.0.1:1"));
        d.apply(data(View::Layers));
        let s = screen(&mut d);
        assert!(
            s.contains("MoE layers (2; 6 experts each)") && s.contains("70.0%") && s.contains("MTP: absent"),
            "{s}"
        );
        d.key(KeyCode::Down, KeyModifiers::NONE);
        d.key(KeyCode::Down, KeyModifiers::NONE); // clamped at the last row
        assert_eq!(d.layer_state.selected(), Some(1));
        d.key(KeyCode::Enter, KeyModifiers::NONE);
        assert_eq!(d.view, View::Experts(1));
        assert!(screen(&mut d).contains("loading the experts of layer 1"));
        d.apply(data(View::Experts(1)));
        let s = screen(&mut d);
        assert!(s.contains("experts of layer 1 (layers.1, q4g64)") && s.contains("resident"), "{s}");
        d.key(KeyCode::PageUp, KeyModifiers::NONE);
        assert_eq!(d.expert_state.selected(), Some(0));
        d.key(KeyCode::Esc, KeyModifiers::NONE);
        assert_eq!(d.view, View::Layers);
        d.apply(Fetched::Down("connection refused".into()));
        let s = screen(&mut d);
        assert!(s.contains("waiting for the server at http://127.0.0.1:1") && s.contains("connection refused"), "{s}");
        d.apply(data(View::Layers));
        assert!(screen(&mut d).contains("MoE layers"));
        assert!(!d.key(KeyCode::Char('q'), KeyModifiers::NONE));
    }
}
