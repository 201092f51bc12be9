//! `cherenkov status`: registered models, free disk, NVIDIA GPUs, and running servers.
//!
//! GPUs: `nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader` when it
//! runs, else the names in `/proc/driver/nvidia/gpus/*/information` (memory unknown), else none.
//! Servers: the files `$CHERENKOV_HOME/servers/<pid>.json` that running servers write
//! (`cherenkov_registry::servers`); one counts as running when its process is alive and
//! `GET {url}/v1/models` answers.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use cherenkov_hub::HubCache;
use cherenkov_hub::cache::short;
use cherenkov_hub::disk::space;
use cherenkov_model::store::load_manifest;
use cherenkov_registry::Registry;
use cherenkov_registry::servers::process_alive;
use indicatif::HumanBytes;
use serde::Serialize;

use crate::inspect::expert_precision;
use crate::integrity::stamp_state;
use crate::stores::dir_bytes;

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Status {
    home: PathBuf,
    models: Vec<Model>,
    disk_stores: usize,
    disk: Vec<Disk>,
    gpu: Gpus,
    servers: Vec<Server>,
}

#[derive(Serialize)]
struct Model {
    name: String,
    source: String,
    revision: Option<String>,
    store: PathBuf,
    experts: Option<String>,
    bytes: Option<u64>,
    /// From the store's integrity stamp (no file is read).
    integrity: String,
}

#[derive(Serialize)]
struct Disk {
    /// The places on this file system, as `stores: /path; Hugging Face cache: /path`.
    what: String,
    path: PathBuf,
    /// Other places on the same file system.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    also: Vec<PathBuf>,
    free: u64,
    total: u64,
}

#[derive(Serialize, Debug, PartialEq)]
struct Gpu {
    name: String,
    memory_total_mib: Option<u64>,
    memory_used_mib: Option<u64>,
}

#[derive(Serialize)]
struct Gpus {
    gpus: Vec<Gpu>,
    /// How they were found, or why none was.
    detail: String,
}

#[derive(Serialize)]
struct Server {
    pid: u32,
    file: PathBuf,
    url: Option<String>,
    model: Option<String>,
    /// `running`, `not answering`, `stale` (the process is gone) or `unreadable`.
    state: String,
    /// The model ids `GET /v1/models` lists.
    serving: Vec<String>,
    detail: String,
}

/// Parses `nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader` (with or
/// without `nounits`).
fn parse_nvidia_smi(text: &str) -> Vec<Gpu> {
    let mib = |s: &str| s.trim().trim_end_matches("MiB").trim().parse::<u64>().ok();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            Gpu {
                name: f[0].trim().to_string(),
                memory_total_mib: f.get(1).and_then(|s| mib(s)),
                memory_used_mib: f.get(2).and_then(|s| mib(s)),
            }
        })
        .collect()
}

fn gpus() -> Gpus {
    let smi = Command::new("nvidia-smi")
        .args(["--query-gpu=name,memory.total,memory.used", "--format=csv,noheader"])
        .output();
    let smi_note = match &smi {
        Ok(o) if o.status.success() => {
            let g = parse_nvidia_smi(&String::from_utf8_lossy(&o.stdout));
            if !g.is_empty() {
                return Gpus { gpus: g, detail: "nvidia-smi".into() };
            }
            "nvidia-smi listed no GPU".to_string()
        }
        Ok(o) => format!(
            "nvidia-smi failed: {}",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .chain(String::from_utf8_lossy(&o.stdout).lines())
                .next()
                .unwrap_or("")
                .trim()
        ),
        Err(_) => "nvidia-smi not found".to_string(),
    };
    let proc_dir = Path::new("/proc/driver/nvidia/gpus");
    let mut from_proc: Vec<Gpu> = std::fs::read_dir(proc_dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| {
                    let info = std::fs::read_to_string(e.path().join("information")).unwrap_or_default();
                    let name = info
                        .lines()
                        .find_map(|l| l.strip_prefix("Model:").map(|m| m.trim().to_string()))
                        .unwrap_or_else(|| format!("NVIDIA GPU at {}", e.file_name().to_string_lossy()));
                    Gpu { name, memory_total_mib: None, memory_used_mib: None }
                })
                .collect()
        })
        .unwrap_or_default();
    from_proc.sort_by(|a, b| a.name.cmp(&b.name));
    if !from_proc.is_empty() {
        return Gpus { gpus: from_proc, detail: format!("{} (memory unknown: {smi_note})", proc_dir.display()) };
    }
    Gpus { gpus: vec![], detail: format!("no NVIDIA GPU detected ({smi_note}; no {})", proc_dir.display()) }
}

/// Asks a server which models it serves.
fn ask_server(url: &str) -> std::result::Result<Vec<String>, String> {
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(format!("{url:?} is not an http:// URL"));
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(3)))
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    let endpoint = format!("{}/v1/models", url.trim_end_matches('/'));
    let mut resp = agent.get(&endpoint).call().map_err(|e| format!("GET {endpoint} failed: {e}"))?;
    if resp.status() != 200 {
        return Err(format!("GET {endpoint} answered HTTP {}", resp.status().as_u16()));
    }
    let body =
        resp.body_mut().with_config().limit(1 << 20).read_to_vec().map_err(|e| format!("GET {endpoint}: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| format!("GET {endpoint}: not the expected JSON: {e}"))?;
    let ids = v
        .get("data")
        .and_then(|d| d.as_array())
        .map(|a| a.iter().filter_map(|m| m.get("id").and_then(|i| i.as_str()).map(String::from)).collect())
        .ok_or_else(|| format!("GET {endpoint}: no \"data\" list"))?;
    Ok(ids)
}

fn servers(reg: &Registry) -> Result<Vec<Server>> {
    let mut out = Vec::new();
    for f in reg.server_files()? {
        let s = match &f.record {
            Err(why) => Server {
                pid: f.pid,
                file: f.path.clone(),
                url: None,
                model: None,
                state: "unreadable".into(),
                serving: vec![],
                detail: why.clone(),
            },
            Ok(r) => {
                let (state, serving, detail) = if !process_alive(r.pid) {
                    ("stale", vec![], format!("process {} is not running; {} can be deleted", r.pid, f.path.display()))
                } else {
                    match ask_server(&r.url) {
                        Ok(ids) => ("running", ids, format!("{}/v1/models answers", r.url.trim_end_matches('/'))),
                        Err(e) => ("not answering", vec![], e),
                    }
                };
                Server {
                    pid: r.pid,
                    file: f.path.clone(),
                    url: Some(r.url.clone()),
                    model: Some(r.model.clone()),
                    state: state.into(),
                    serving,
                    detail,
                }
            }
        };
        out.push(s);
    }
    Ok(out)
}

pub fn run(args: &StatusArgs, out: &mut dyn Write) -> Result<()> {
    let reg = Registry::open_default()?;
    let index = reg.index()?;
    let models: Vec<Model> = index
        .models
        .values()
        .map(|e| Model {
            name: e.name.clone(),
            source: e.source.clone(),
            revision: e.revision.clone(),
            store: e.store.clone(),
            experts: load_manifest(&e.store).ok().map(|m| expert_precision(&m)),
            bytes: dir_bytes(&e.store).ok(),
            integrity: if e.store.join("manifest.json").is_file() {
                stamp_state(&e.store).into()
            } else {
                "store missing".into()
            },
        })
        .collect();
    let mut disk = Vec::new();
    let mut devices = Vec::new();
    let mut places = vec![("stores".to_string(), reg.stores_dir())];
    if let Ok(c) = HubCache::from_env() {
        places.push(("Hugging Face cache".to_string(), c.root));
    }
    for (what, path) in places {
        if let Ok(s) = space(&path) {
            match devices.iter().position(|d| *d == s.device) {
                // The same file system: one line names both places.
                Some(i) => {
                    let d: &mut Disk = &mut disk[i];
                    d.what = format!("{}; {what}: {}", d.what, path.display());
                    d.also.push(path);
                }
                None => {
                    devices.push(s.device);
                    let what = format!("{what}: {}", path.display());
                    disk.push(Disk { what, path, also: vec![], free: s.free, total: s.total });
                }
            }
        }
    }
    let status = Status {
        home: reg.home().to_path_buf(),
        models,
        disk_stores: index.stores.len(),
        disk,
        gpu: gpus(),
        servers: servers(&reg)?,
    };
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&status)?)?;
        return Ok(());
    }
    writeln!(out, "home      {}", status.home.display())?;
    if status.models.is_empty() {
        writeln!(out, "models    none registered")?;
    } else {
        writeln!(out, "models    {} registered", status.models.len())?;
        for m in &status.models {
            let rev = m.revision.as_deref().map(|r| format!(" @ {}", short(r))).unwrap_or_default();
            writeln!(
                out,
                "  {}  {}{rev}  {}  {}  {}",
                m.name,
                m.source,
                m.experts.as_deref().unwrap_or("-"),
                m.bytes.map(|b| HumanBytes(b).to_string()).unwrap_or_else(|| "-".into()),
                m.integrity
            )?;
        }
    }
    if status.disk_stores > 0 {
        writeln!(out, "disk stores {} registered (cherenkov store list)", status.disk_stores)?;
    }
    for (i, d) in status.disk.iter().enumerate() {
        writeln!(
            out,
            "{}{} free of {} ({})",
            if i == 0 { "disk      " } else { "          " },
            HumanBytes(d.free),
            HumanBytes(d.total),
            d.what
        )?;
    }
    if status.gpu.gpus.is_empty() {
        writeln!(out, "gpu       {}", status.gpu.detail)?;
    }
    for (i, g) in status.gpu.gpus.iter().enumerate() {
        let mem = match (g.memory_total_mib, g.memory_used_mib) {
            (Some(t), Some(u)) => format!("{} used of {}", HumanBytes(u << 20), HumanBytes(t << 20)),
            (Some(t), None) => format!("{} total", HumanBytes(t << 20)),
            _ => "memory unknown".into(),
        };
        writeln!(
            out,
            "{}{i}: {}, {mem} (via {})",
            if i == 0 { "gpu       " } else { "          " },
            g.name,
            status.gpu.detail
        )?;
    }
    if status.servers.is_empty() {
        writeln!(out, "server    none running")?;
    }
    for (i, s) in status.servers.iter().enumerate() {
        let lead = if i == 0 { "server    " } else { "          " };
        let what = match s.state.as_str() {
            "running" => format!(
                "pid {} at {} serving {} ({})",
                s.pid,
                s.url.as_deref().unwrap_or("?"),
                if s.serving.is_empty() { s.model.clone().unwrap_or_default() } else { s.serving.join(", ") },
                s.detail
            ),
            state => format!("pid {} {state}: {}", s.pid, s.detail),
        };
        writeln!(out, "{lead}{what}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nvidia_smi() {
        let g = parse_nvidia_smi("NVIDIA H200, 143771 MiB, 1 MiB\nNVIDIA H200, 143771, 70000\n\n");
        assert_eq!(g.len(), 2);
        assert_eq!(g[0], Gpu { name: "NVIDIA H200".into(), memory_total_mib: Some(143771), memory_used_mib: Some(1) });
        assert_eq!(g[1].memory_used_mib, Some(70000));
        assert_eq!(parse_nvidia_smi("Tesla T4, [N/A], [N/A]")[0].memory_total_mib, None);
    }
}
