//! Several processes register different names in one home at once; none is lost.
//!
//! The test re-runs its own binary as the workers (`CHERENKOV_REGISTRY_WORKER` set), so the
//! registrations really come from separate processes with separate locks.

use std::process::Command;

use cherenkov_registry::{Entry, Registry};

const WORKER_ENV: &str = "CHERENKOV_REGISTRY_WORKER";
const PER_WORKER: usize = 30;

fn work(home: &str, worker: &str) {
    let reg = Registry::open(home.as_ref()).unwrap();
    // Start together: every worker waits for the parent's `go` file.
    let go = std::path::Path::new(home).join("go");
    let start = std::time::Instant::now();
    while !go.exists() {
        assert!(start.elapsed().as_secs() < 60, "no go signal");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    for i in 0..PER_WORKER {
        let name = format!("p{worker}-m{i}");
        reg.register(Entry::new(&name, reg.stores_dir().join(&name), "/src")).unwrap();
    }
}

#[test]
fn processes_register_concurrently() {
    if let Ok(spec) = std::env::var(WORKER_ENV) {
        let (home, worker) = spec.split_once('\n').unwrap();
        work(home, worker);
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let workers: Vec<_> = (0..6)
        .map(|w| {
            Command::new(&exe)
                .args(["--exact", "processes_register_concurrently", "--test-threads=1"])
                .env(WORKER_ENV, format!("{}\n{w}", home.path().display()))
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    std::fs::write(home.path().join("go"), "").unwrap();
    for mut w in workers {
        assert!(w.wait().unwrap().success());
    }
    let names = Registry::open(home.path()).unwrap().list().unwrap();
    assert_eq!(names.len(), 6 * PER_WORKER);
}
