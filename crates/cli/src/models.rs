//! `cherenkov model list` and `cherenkov model remove`.

use std::io::Write;

use anyhow::{Result, bail};
use cherenkov_model::store::load_manifest;
use cherenkov_registry::{Entry, Registry};
use indicatif::HumanBytes;
use serde::Serialize;

use crate::inspect::{expert_precision, layout_label};
use crate::stores::dir_bytes;

#[derive(clap::Subcommand, Debug)]
pub enum ModelCommand {
    /// List registered models: name, store path, source, layout (hf/mlx), expert precision, size on disk.
    #[command(after_help = "Example:\n  cherenkov model list\n  cherenkov model list --json")]
    List {
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Forget a registered name. The store stays on disk (other names may share it).
    #[command(after_help = "Example:\n  cherenkov model remove flash")]
    Remove {
        /// The registered name.
        name: String,
    },
}

/// One row of the listing.
#[derive(Serialize)]
struct Row {
    #[serde(flatten)]
    entry: Entry,
    /// `hf` or `mlx`, or why the store could not be read.
    layout: String,
    experts: String,
    bytes: Option<u64>,
}

fn row(entry: Entry) -> Row {
    match load_manifest(&entry.store) {
        Ok(m) => {
            let bytes = dir_bytes(&entry.store).ok();
            Row { layout: layout_label(m.source.layout).into(), experts: expert_precision(&m), bytes, entry }
        }
        Err(_) if !entry.store.exists() => {
            Row { layout: "?".into(), experts: "store missing".into(), bytes: None, entry }
        }
        Err(_) => Row { layout: "?".into(), experts: "store unreadable".into(), bytes: None, entry },
    }
}

pub fn run(cmd: &ModelCommand, out: &mut dyn Write) -> Result<()> {
    let reg = Registry::open_default()?;
    match cmd {
        ModelCommand::List { json } => list(&reg, *json, out),
        ModelCommand::Remove { name } => match reg.remove(name)? {
            Some(e) => {
                writeln!(out, "removed {name} (its store {} stays on disk)", e.store.display())?;
                Ok(())
            }
            None => bail!("no model named {name:?} is registered (see cherenkov model list)"),
        },
    }
}

fn list(reg: &Registry, json: bool, out: &mut dyn Write) -> Result<()> {
    let rows: Vec<Row> = reg.list()?.into_iter().map(row).collect();
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&rows)?)?;
        return Ok(());
    }
    if rows.is_empty() {
        writeln!(
            out,
            "no models registered in {} (cherenkov prepare CHECKPOINT_DIR --name NAME)",
            reg.home().display()
        )?;
        return Ok(());
    }
    let cells: Vec<[String; 6]> = rows
        .iter()
        .map(|r| {
            [
                r.entry.name.clone(),
                r.entry.store.display().to_string(),
                r.entry.source.clone(),
                r.layout.clone(),
                r.experts.clone(),
                r.bytes.map(|b| HumanBytes(b).to_string()).unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let header = ["NAME", "STORE", "SOURCE", "LAYOUT", "EXPERTS", "SIZE"].map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for c in &cells {
        for (w, s) in widths.iter_mut().zip(c) {
            *w = (*w).max(s.chars().count());
        }
    }
    for line in std::iter::once(&header).chain(&cells) {
        let text: Vec<String> = line.iter().zip(widths).map(|(s, w)| format!("{s:<w$}")).collect();
        writeln!(out, "{}", text.join("  ").trim_end())?;
    }
    Ok(())
}
