//! `cherenkov stats` and `cherenkov dash` against a real `cherenkov serve` of the tiny-b fixture on
//! a free port: the tables, `--json` against `docs/stats.schema.json`, finding the server through
//! `$CHERENKOV_HOME/servers`, the errors when nothing answers, and the dashboard driven in tmux
//! (start, select, Enter into a layer, Escape back, page, a server restart, quit).

mod common;
#[path = "../../server/tests/common/json_schema.rs"]
mod json_schema;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{Home, fixture};
use serde_json::Value;

/// A `cherenkov serve` child, stopped (SIGTERM, then SIGKILL) when dropped.
struct Serve {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Serve {
    /// Starts `serve --model MODEL --port PORT` and waits until it prints its URL.
    fn start(home: &Home, model: &str, port: u16, log_name: &str) -> Serve {
        let log = home.scratch(log_name);
        let mut child = home
            .command(&["serve", "--model", model, "--port", &port.to_string(), "--backend", "cpu"])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut serve = Serve { child, url: String::new(), log };
        let line = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("serve printed nothing:\n{}", serve.stderr()));
        let url = line.split(" at ").nth(1).and_then(|r| r.split("/v1").next()).unwrap_or_else(|| panic!("{line}"));
        serve.url = url.to_string();
        serve
    }

    fn port(&self) -> u16 {
        self.url.rsplit(':').next().unwrap().parse().unwrap()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A few tokens, so the counters have something to show.
    fn generate(&self, prompt: &str) {
        let body =
            serde_json::json!({"model": "cherenkov", "prompt": prompt, "max_tokens": 6, "temperature": 0}).to_string();
        let mut r = ureq::post(format!("{}/v1/completions", self.url))
            .header("Content-Type", "application/json")
            .send(body.as_str())
            .unwrap_or_else(|e| panic!("completion failed: {e}\n{}", self.stderr()));
        let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0, "{v}");
    }

    fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.halt();
    }
}

fn tiny() -> String {
    fixture("tiny-b/mlx4").display().to_string()
}

fn schema() -> json_schema::Schema {
    json_schema::Schema::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/stats.schema.json"))
}

fn stdout_of(home: &Home, args: &[&str]) -> String {
    let o = home.run(args);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "cherenkov {args:?} failed:\n{out}{}", String::from_utf8_lossy(&o.stderr));
    out
}

#[test]
fn stats_commands_print_tables_and_json() {
    let home = Home::new();
    let server = Serve::start(&home, &tiny(), 0, "serve.log");
    server.generate("Hash tables store keys");
    server.generate("Hash tables store values");
    let url = server.url.clone();
    let port = server.port().to_string();

    let s = stdout_of(&home, &["stats", "summary", "--url", &format!("{url}/v1")]);
    for want in [
        "server ",
        "decode ",
        "time ",
        "experts ",
        "lookahead ",
        "prefix ",
        "mtp        absent",
        "2 completed",
        "cpu backend",
    ] {
        assert!(s.contains(want), "no {want:?} in\n{s}");
    }
    let l = stdout_of(&home, &["stats", "layers", "--port", &port]);
    let lines: Vec<&str> = l.lines().collect();
    assert!(lines[0].starts_with("layer  name") && lines[0].contains("hit") && lines[0].contains("p99"), "{l}");
    assert!(
        lines[1].starts_with("0      layers.0  q4g64")
            && lines[2].starts_with("1      layers.1")
            && lines[3].starts_with("total"),
        "{l}"
    );
    assert!(lines[1].contains('%'), "a hit rate once requests ran:\n{l}");
    let x = stdout_of(&home, &["stats", "experts", "1", "--url", &url]);
    assert!(x.starts_with("layer 1 (layers.1), records q4g64 of 24 KiB"), "{x}");
    assert_eq!(x.lines().count(), 2 + 6, "a header and six experts:\n{x}");
    assert!(stdout_of(&home, &["stats", "steps", "--url", &url]).lines().nth(1).unwrap().contains("prefill"));

    // --json: the server's documents, whole and valid.
    let sch = schema();
    for (args, def) in [
        (vec!["stats", "summary", "--json"], "summary"),
        (vec!["stats", "layers", "--json"], "layers"),
        (vec!["stats", "experts", "0", "--json"], "experts"),
        (vec!["stats", "steps", "--json"], "steps"),
    ] {
        let mut a = args.clone();
        a.extend(["--url", url.as_str()]);
        let v: Value = serde_json::from_str(&stdout_of(&home, &a)).unwrap();
        sch.assert_valid(def, &v);
    }

    // Without --url/--port: the server announced in $CHERENKOV_HOME/servers.
    let found = stdout_of(&home, &["stats", "summary"]);
    assert!(found.starts_with(&format!("server     {url} ")), "{found}");

    // Errors: a layer the model lacks, a port nothing listens on, a bad URL.
    let e = home.fails(&["stats", "experts", "7", "--url", &url]);
    assert!(e.contains("HTTP 404") && e.contains("the model has 2"), "{e}");
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let e = home.fails(&["stats", "layers", "--port", &dead]);
    assert!(
        e.contains(&format!("no Cherenkov server answers at http://127.0.0.1:{dead}")) && e.contains("cherenkov serve"),
        "{e}"
    );
    let e = home.fails(&["stats", "summary", "--url", "localhost:1"]);
    assert!(e.contains("is not an http:// URL"), "{e}");
    server.stop();
}

/// tmux on a private socket, killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn cmd(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux").args(["-L", &self.socket, "-f", "/dev/null"]).args(args).output().unwrap()
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.cmd(&["capture-pane", "-p", "-t", "dash"]).stdout).into_owned()
    }

    fn keys(&self, keys: &[&str]) {
        let mut a = vec!["send-keys", "-t", "dash"];
        a.extend(keys);
        assert!(self.cmd(&a).status.success());
    }

    /// Waits until the screen satisfies `ok`; panics with the screen after 30 s.
    fn wait(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let t = Instant::now();
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            if t.elapsed() > Duration::from_secs(30) {
                panic!("the dashboard never showed {what}; the screen:\n{s}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

/// The line of the table row whose first column is `layer` or `expert` `n`, selected or not.
fn row(screen: &str, n: usize) -> Option<&str> {
    screen.lines().find(|l| {
        let cell = l.trim_start_matches('│').trim_start_matches("> ").trim_start();
        cell.split_whitespace().next() == Some(&n.to_string()) && l.starts_with('│')
    })
}

fn selected(screen: &str, n: usize) -> bool {
    screen.lines().any(|l| l.starts_with(&format!("│> {n} ")))
}

#[test]
fn dashboard_in_tmux() {
    if Command::new("tmux").arg("-V").output().is_err() {
        assert!(
            std::env::var("CHERENKOV_REQUIRE_TMUX").as_deref() != Ok("1"),
            "tmux is not installed, and CHERENKOV_REQUIRE_TMUX=1 (tools/test sets it): the dashboard test must run. \
             Install tmux (apt-get install -y tmux)"
        );
        eprintln!("skipping the dashboard test: tmux is not installed (tools/test installs it and requires it)");
        return;
    }
    let home = Home::new();
    let server = Serve::start(&home, &tiny(), 0, "serve.log");
    server.generate("Explain hash collisions.");
    let (url, port) = (server.url.clone(), server.port());
    let tmux = Tmux { socket: format!("cherenkov-dash-test-{}", std::process::id()) };
    let bin = env!("CARGO_BIN_EXE_cherenkov");
    let cmd = format!("'{bin}' dash --url {url} --interval 0.3; echo dash-exited-$?; sleep 600");
    let o = tmux.cmd(&["new-session", "-d", "-s", "dash", "-x", "130", "-y", "32", &cmd]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // Start: the summary, the sparkline and the layers, with numbers from the request above.
    let s = tmux.wait("the layer table", |s| s.contains("MoE layers (2; 6 experts each)") && row(s, 1).is_some());
    assert!(s.contains(&format!("cherenkov dash  {url}")) && s.contains("cpu backend"), "{s}");
    assert!(s.contains("generated tokens/s") && s.contains("MTP: absent") && s.contains("time: dense"), "{s}");
    assert!(row(&s, 0).unwrap().contains('%') && selected(&s, 0), "layer 0 has a hit rate and is selected:\n{s}");

    // Down selects layer 1; Enter opens its experts.
    tmux.keys(&["Down"]);
    tmux.wait("layer 1 selected", |s| selected(s, 1));
    tmux.keys(&["Enter"]);
    let s = tmux
        .wait("the experts of layer 1", |s| s.contains("experts of layer 1 (layers.1, q4g64)") && row(s, 5).is_some());
    assert!(s.contains("Esc back") && s.contains("prefetched") && selected(&s, 0), "{s}");
    // PageDown goes to the last expert (six fit on a page), PageUp back to the first.
    tmux.keys(&["PageDown"]);
    tmux.wait("the last expert selected", |s| selected(s, 5));
    tmux.keys(&["PageUp"]);
    tmux.wait("the first expert selected", |s| selected(s, 0));

    // Escape returns to the layers, with layer 1 still selected.
    tmux.keys(&["Escape"]);
    tmux.wait("the layer table again", |s| s.contains("MoE layers (2;") && selected(s, 1));

    // The server goes away: the dashboard waits; it comes back on the same port: the data returns.
    server.stop();
    tmux.wait("the waiting message", |s| s.contains(&format!("waiting for the server at {url}")));
    let again = Serve::start(&home, &tiny(), port, "serve2.log");
    tmux.wait("the restarted server", |s| s.contains("MoE layers (2;") && !s.contains("waiting for the server"));

    // q quits, restoring the terminal, with status 0.
    tmux.keys(&["q"]);
    let s = tmux.wait("the dashboard to exit", |s| s.contains("dash-exited-"));
    assert!(s.contains("dash-exited-0"), "{s}");
    assert!(!s.contains("MoE layers"), "the alternate screen was left:\n{s}");
    again.stop();
}
