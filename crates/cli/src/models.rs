//! `cherenkov model list`, `model remove` and `model gc`.

use std::io::Write;

use anyhow::{Result, bail};
use cherenkov_hub::cache::short;
use cherenkov_model::store::load_manifest;
use cherenkov_registry::{Entry, Registry};
use indicatif::HumanBytes;
use serde::Serialize;

use crate::inspect::{expert_precision, layout_label};
use crate::resolve::entries_for;
use crate::source::Source;
use crate::stores::dir_bytes;

#[derive(clap::Subcommand, Debug)]
pub enum ModelCommand {
    /// List registered models: name, store, source, revision, layout (hf/mlx), expert precision of
    /// the store, size on disk.
    #[command(after_help = "Examples:\n  cherenkov model list\n  cherenkov model list --json")]
    List {
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Release a registration. The store stays on disk until `model gc` finds no name uses it.
    #[command(after_help = "Examples:\n  cherenkov model remove flash\n  \
            cherenkov model remove hf://Org/Model-4bit@main")]
    Remove {
        /// A registered name, or the source (URI or checkpoint directory) it was prepared from;
        /// a source releases every name prepared from it.
        model: String,
    },
    /// Delete the managed stores ($CHERENKOV_HOME/stores) that no registered name uses, and
    /// unfinished ones left by interrupted prepares.
    #[command(after_help = "Examples:\n  cherenkov model gc --dry-run\n  cherenkov model gc")]
    Gc {
        /// List what would be deleted and the bytes it holds; delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// One row of the listing.
#[derive(Serialize)]
struct Row {
    #[serde(flatten)]
    entry: Entry,
    /// `hf` or `mlx`, or why the store could not be read.
    layout: String,
    /// The expert precision of the store (`q4g64`, or `q3g32+q4g32` when layers differ).
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
        ModelCommand::Remove { model } => remove(&reg, model, out),
        ModelCommand::Gc { dry_run } => crate::gc::run(&reg, *dry_run, out),
    }
}

fn remove(reg: &Registry, model: &str, out: &mut dyn Write) -> Result<()> {
    let names: Vec<String> = match Source::parse(model)? {
        Some(src) => {
            let found = entries_for(reg, &src)?;
            if found.is_empty() {
                bail!("no registered model was prepared from {} (see cherenkov model list)", src.uri());
            }
            found.into_iter().map(|e| e.name).collect()
        }
        None if reg.get(model)?.is_none() && std::path::Path::new(model).exists() => {
            // A checkpoint directory: the names prepared from it.
            let canon = std::fs::canonicalize(model).map(|p| p.display().to_string()).unwrap_or_else(|_| model.into());
            let found: Vec<String> = reg.list()?.into_iter().filter(|e| e.source == canon).map(|e| e.name).collect();
            if found.is_empty() {
                bail!("no registered model was prepared from {canon} (see cherenkov model list)");
            }
            found
        }
        None => vec![model.to_string()],
    };
    let removed = reg.update(|models| {
        let mut removed = Vec::new();
        for n in &names {
            match models.remove(n) {
                Some(e) => removed.push(e),
                None => bail!("no model named {n:?} is registered (see cherenkov model list)"),
            }
        }
        let still: Vec<(Entry, Vec<String>)> = removed
            .into_iter()
            .map(|e| {
                let users = models.values().filter(|o| o.store == e.store).map(|o| o.name.clone()).collect();
                (e, users)
            })
            .collect();
        Ok(still)
    })?;
    let managed = reg.stores_dir();
    for (e, users) in removed {
        let about = if !users.is_empty() {
            format!("its store {} is still used by {}", e.store.display(), users.join(", "))
        } else if e.store.starts_with(&managed) {
            let size = dir_bytes(&e.store).map(|b| format!(" ({})", HumanBytes(b))).unwrap_or_default();
            format!("its store {}{size} is no longer used: cherenkov model gc deletes it", e.store.display())
        } else {
            format!("its store {} is not managed by Cherenkov and stays", e.store.display())
        };
        writeln!(out, "removed {}; {about}", e.name)?;
    }
    Ok(())
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
            "no models registered in {} (cherenkov prepare CHECKPOINT_DIR|hf://org/repo|disk://STORE/path --name NAME)",
            reg.home().display()
        )?;
        return Ok(());
    }
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.entry.name.clone(),
                r.entry.store.display().to_string(),
                r.entry.source.clone(),
                r.entry.revision.as_deref().map(short).unwrap_or("-").to_string(),
                r.layout.clone(),
                r.experts.clone(),
                r.bytes.map(|b| HumanBytes(b).to_string()).unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let header = ["NAME", "STORE", "SOURCE", "REVISION", "LAYOUT", "EXPERTS", "SIZE"].map(String::from);
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
