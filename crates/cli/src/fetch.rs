//! `prepare hf://org/repo[@revision]`: resolve the revision to a commit, download the files a
//! checkpoint needs into the Hugging Face cache (where `huggingface_hub` would put them; resumed
//! and hash-checked by `cherenkov-hub`), pack, register, and remove the files this command
//! downloaded unless `--keep-source`.
//!
//! Downloaded: `config.json`, `model.safetensors.index.json`, the tokenizer and template files
//! the store keeps, and the weights: the shards the index names, or every top-level
//! `*.safetensors` without an index. Nothing else (READMEs, other formats, subfolders).
//!
//! Nothing is registered until the store is complete. A failed or interrupted download keeps
//! what it fetched (complete files, and `.incomplete` blobs the next run resumes with a Range
//! request); a failed pack keeps the whole download, so running the command again packs without
//! downloading. What Cherenkov downloaded is journaled in the cache's `.locks` folder, so the
//! run that finally packs removes all of it, including files earlier runs fetched, and nothing
//! that other tools had put in the cache.

use std::fs::File;
use std::io::Write;

use anyhow::{Context, Result, bail};
use cherenkov_hub::cache::short;
use cherenkov_hub::{
    Check, DownloadOptions, Downloaded, FileMeta, Hub, HubCache, Plan, RepoRef, Sibling, download, journal_path,
    remove_journaled,
};
use cherenkov_model::store::pack::SIDE_FILES;
use cherenkov_registry::{Entry, Registry};
use indicatif::{HumanBytes, ProgressBar};

use crate::prepare::{
    PrepareArgs, PrepareOptions, Prepared, check_conflict, open_checkpoint, prepare_checkpoint_with, report,
};
use crate::progress::bytes_bar;
use crate::source::Source;
use crate::{space, stores};

const INDEX: &str = "model.safetensors.index.json";

pub fn prepare_hf(reg: &Registry, repo: &RepoRef, name: &str, args: &PrepareArgs, out: &mut dyn Write) -> Result<()> {
    let uri = Source::Hf(repo.clone()).uri();
    // Refuse a name conflict before downloading anything.
    check_conflict(reg.get(name)?.as_ref(), name, &uri, args.force)?;
    let hub = Hub::from_env()?;
    let cache = HubCache::from_env()?;
    eprintln!(
        "resolving {uri} at {}{}",
        hub.endpoint(),
        if hub.has_token() { " with a token (HF_TOKEN or the huggingface-cli login file)" } else { "" }
    );
    let info = hub.repo_info(repo)?;
    let commit = info.commit.clone();
    eprintln!("{repo} is commit {commit}");
    if !args.repack
        && let Some(store) = stores::find_by_commit(reg, &reg.models()?, &repo.repo, &commit)
    {
        let p = register_existing(reg, name, &uri, &commit, &store, args.force)?;
        eprintln!(
            "reused the complete store {} (already prepared from {} at commit {})",
            store.display(),
            repo.repo,
            short(&commit)
        );
        return report(&p, out);
    }

    let top: Vec<&Sibling> = info.files.iter().filter(|s| !s.name.contains('/')).collect();
    if !top.iter().any(|s| s.name == "config.json") {
        let names: Vec<&str> = info.files.iter().take(12).map(|s| s.name.as_str()).collect();
        bail!(
            "{uri} (commit {commit}) has no config.json at its top level, so it is not a model checkpoint (its files: {})",
            if names.is_empty() { "none".to_string() } else { names.join(", ") }
        );
    }
    // Held (shared) while the files are used, so that a concurrent prepare of the same commit does
    // not remove them underneath this one.
    let snapshot_lock = lock_snapshot(&cache, &repo.repo, &commit)?;
    // Every blob this command (or an earlier, interrupted one) downloads is journaled, so that the
    // cleanup removes exactly what Cherenkov fetched, never what other tools put in the cache.
    let journal = journal_path(&cache, &repo.repo, &commit);
    let opts = DownloadOptions { journal: Some(journal.clone()), ..DownloadOptions::default() };
    let side: Vec<&Sibling> =
        top.iter().copied().filter(|s| SIDE_FILES.contains(&s.name.as_str()) || s.name == INDEX).collect();
    let small_plan = Plan::new(&cache, &repo.repo, &repo.revision, &commit, metas(&hub, repo, &commit, &side)?);
    let log = |l: &str| eprintln!("{l}");
    let small = download(&hub, &cache, &small_plan, &opts, &ProgressBar::hidden(), &log)?;
    let snapshot = small.snapshot.clone();

    let weights: Vec<&Sibling> = if small_plan.files.iter().any(|f| f.meta.name == INDEX) {
        let text = std::fs::read_to_string(snapshot.join(INDEX))
            .with_context(|| format!("cannot read {}", snapshot.join(INDEX).display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{INDEX} of {uri}: not valid JSON"))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{INDEX} of {uri}: no weight_map"))?;
        let mut shards: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
        shards.sort();
        shards.dedup();
        shards
            .into_iter()
            .map(|f| {
                top.iter().copied().find(|s| s.name == f).with_context(|| {
                    format!(
                        "{INDEX} of {uri} (commit {commit}) names the shard {f}, which the repository does not have"
                    )
                })
            })
            .collect::<Result<_>>()?
    } else {
        top.iter().copied().filter(|s| s.name.ends_with(".safetensors")).collect()
    };
    if weights.is_empty() {
        bail!(
            "{uri} (commit {commit}) has no .safetensors weights at its top level; Cherenkov reads safetensors checkpoints"
        );
    }
    let plan = Plan::new(&cache, &repo.repo, &repo.revision, &commit, metas(&hub, repo, &commit, &weights)?);
    let quantized = std::fs::read_to_string(snapshot.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| v.get("quantization").is_some() || v.get("quantization_config").is_some());
    let room = space::check(&[
        space::Need { what: "to download", dir: cache.root.clone(), bytes: plan.bytes_to_fetch() },
        space::Need {
            what: "for the packed store",
            dir: reg.stores_dir(),
            bytes: space::store_estimate(plan.total_bytes(), quantized),
        },
    ])?;
    let mut have = Vec::new();
    if plan.complete_files() > 0 {
        have.push(format!("{} already in the Hugging Face cache", plan.complete_files()));
    }
    if plan.partial_bytes() > 0 {
        have.push(format!("{} of partial downloads to resume", HumanBytes(plan.partial_bytes())));
    }
    eprintln!(
        "{} weight file(s), {}{}; {room}",
        plan.files.len(),
        HumanBytes(plan.total_bytes()),
        if have.is_empty() { String::new() } else { format!(" ({})", have.join(", ")) }
    );
    let bar = bytes_bar("downloading");
    let log = |l: &str| bar.suspend(|| eprintln!("{l}"));
    let big = download(&hub, &cache, &plan, &opts, &bar, &log)?;
    bar.finish_and_clear();
    eprintln!("{}", summary(&small, &big));

    let ck = open_checkpoint(&snapshot).map_err(|e| {
        e.context(format!(
            "the download of {uri} in {} is not a usable checkpoint (the files stay there)",
            snapshot.display()
        ))
    })?;
    let popts = PrepareOptions {
        name: name.to_string(),
        source: uri.clone(),
        revision: Some(commit.clone()),
        force: args.force,
        repack: args.repack,
    };
    let p = prepare_checkpoint_with(reg, &ck, &popts).map_err(|e| {
        e.context(format!(
            "the downloaded checkpoint stays in {}; the same command packs it again without downloading",
            snapshot.display()
        ))
    })?;
    drop(ck);
    if args.keep_source {
        // What was downloaded is the user's now: a later prepare must not remove it.
        let _ = std::fs::remove_file(&journal);
        eprintln!("kept the downloaded checkpoint in {} (--keep-source)", snapshot.display());
    } else if !journal.exists() {
        eprintln!("the checkpoint was in the Hugging Face cache before; it stays in {}", snapshot.display());
    } else if snapshot_lock.try_lock().is_err() {
        eprintln!("another prepare is using {}; the download stays there for now", snapshot.display());
    } else {
        let r = remove_journaled(&cache, &repo.repo, &commit, &journal)?;
        eprintln!(
            "removed the {} ({} file(s)) Cherenkov downloaded from {} (--keep-source keeps them)",
            HumanBytes(r.bytes),
            r.files,
            cache.repo_dir(&repo.repo).display()
        );
    }
    report(&p, out)
}

/// Size, hash and location of each file (one HEAD request each).
fn metas(hub: &Hub, repo: &RepoRef, commit: &str, files: &[&Sibling]) -> Result<Vec<FileMeta>> {
    files.iter().map(|s| hub.file_meta(&repo.repo, commit, s)).collect()
}

/// `.locks/models--org--repo/cherenkov-<commit>.lock`, locked shared.
fn lock_snapshot(cache: &HubCache, repo: &str, commit: &str) -> Result<File> {
    let p = cache.lock_path(repo, &format!("cherenkov-{commit}"));
    if let Some(d) = p.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    let f = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&p)
        .with_context(|| format!("cannot open {}", p.display()))?;
    f.lock_shared().with_context(|| format!("cannot lock {}", p.display()))?;
    Ok(f)
}

/// What the downloads did and how the files were checked.
fn summary(small: &Downloaded, big: &Downloaded) -> String {
    let fetched: Vec<_> = small.fetched.iter().chain(&big.fetched).collect();
    let bytes: u64 = fetched.iter().map(|f| f.bytes).sum();
    let count = |c: &Check| fetched.iter().filter(|f| f.check == *c).count();
    let unchecked: Vec<&str> =
        fetched.iter().filter(|f| matches!(f.check, Check::Unchecked(_))).map(|f| f.name.as_str()).collect();
    let mut checks = vec![
        format!("sha256 checked for {}", count(&Check::Sha256)),
        format!("git blob id for {}", count(&Check::GitSha1)),
    ];
    if !unchecked.is_empty() {
        checks.push(format!("not checked: {}", unchecked.join(", ")));
    }
    let reused = small.reused.len() + big.reused.len();
    format!(
        "downloaded {} file(s) ({}) into {} ({}){}",
        fetched.len(),
        HumanBytes(bytes),
        big.snapshot.display(),
        checks.join(", "),
        if reused > 0 { format!("; {reused} file(s) were in the cache already") } else { String::new() }
    )
}

/// Registers `name` to a store already prepared from this commit.
fn register_existing(
    reg: &Registry,
    name: &str,
    uri: &str,
    commit: &str,
    store: &std::path::Path,
    force: bool,
) -> Result<Prepared> {
    reg.update(|models| {
        check_conflict(models.get(name), name, uri, force)?;
        if !store.join("manifest.json").is_file() {
            bail!("the store {} went away while this command ran (model gc?); run it again", store.display());
        }
        let entry = match models.get(name) {
            Some(e) if e.store == store && e.source == uri && e.revision.as_deref() == Some(commit) => e.clone(),
            _ => Entry::new(name, store.to_path_buf(), uri).with_revision(Some(commit.to_string())),
        };
        models.insert(name.to_string(), entry.clone());
        Ok(Prepared { entry, reused: true })
    })
}
