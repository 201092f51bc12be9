//! Downloads from an imitation of the hub on 127.0.0.1: files land in the hub cache layout with
//! their hashes checked, dropped transfers resume (within a run and across runs), corrupt files
//! and missing revisions fail clearly, and gated repositories need the token.

mod fakehub;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use cherenkov_hub::{
    Check, DownloadOptions, Hub, HubCache, Local, Plan, RepoRef, download, journal_path, remove_journaled,
};
use fakehub::{FakeHub, sha256};
use indicatif::ProgressBar;

const REPO: &str = "org/tiny";

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden/tiny-b/mlx4")
}

fn hub_with_readme() -> FakeHub {
    FakeHub::start(REPO, &fixture(), &[("README.md", b"# tiny\n")])
}

fn fast() -> DownloadOptions {
    DownloadOptions { threads: 2, attempts: 3, backoff: Duration::from_millis(10), journal: None }
}

/// The plan for every file of `rev`, and the log lines of the run.
fn plan(hub: &Hub, cache: &HubCache, rev: &str) -> Plan {
    let info = hub.repo_info(&RepoRef::parse(&format!("{REPO}@{rev}")).unwrap()).unwrap();
    let metas = info.files.iter().map(|s| hub.file_meta(REPO, &info.commit, s).unwrap()).collect();
    Plan::new(cache, REPO, rev, &info.commit, metas)
}

fn run(hub: &Hub, cache: &HubCache, plan: &Plan) -> (anyhow::Result<cherenkov_hub::Downloaded>, Vec<String>) {
    let log = Mutex::new(Vec::new());
    let opts = DownloadOptions { journal: Some(journal_path(cache, REPO, &plan.commit)), ..fast() };
    let r =
        download(hub, cache, plan, &opts, &ProgressBar::hidden(), &|l: &str| log.lock().unwrap().push(l.to_string()));
    (r, log.into_inner().unwrap())
}

#[test]
fn downloads_into_the_cache_layout_with_checked_hashes() {
    let fake = hub_with_readme();
    let tmp = tempfile::tempdir().unwrap();
    let cache = HubCache::new(tmp.path().join("hub"));
    let hub = Hub::new(&fake.url, None).unwrap();
    let plan = plan(&hub, &cache, "main");
    assert_eq!(plan.commit, fake.commit());
    assert_eq!(plan.files.len(), 7);
    assert!(plan.files.iter().all(|f| f.local == Local::Missing));
    let weights = plan.files.iter().find(|f| f.meta.name == "model.safetensors").unwrap();
    assert!(weights.meta.lfs && weights.meta.url.contains("/cdn/"));
    assert_eq!(weights.meta.etag, sha256(&fake.file("model.safetensors")));
    let (d, _) = run(&hub, &cache, &plan);
    let d = d.unwrap();
    assert_eq!(d.snapshot, cache.snapshot_dir(REPO, &plan.commit));
    for f in &plan.files {
        let p = d.snapshot.join(&f.meta.name);
        assert_eq!(std::fs::read(&p).unwrap(), fake.file(&f.meta.name), "{}", f.meta.name);
        let target = std::fs::read_link(&p).unwrap();
        assert_eq!(target, Path::new("../../blobs").join(&f.meta.etag));
    }
    let checks: Vec<(&str, &Check)> = d.fetched.iter().map(|f| (f.name.as_str(), &f.check)).collect();
    assert!(checks.contains(&("model.safetensors", &Check::Sha256)), "{checks:?}");
    assert!(checks.contains(&("config.json", &Check::GitSha1)), "{checks:?}");
    assert_eq!(cache.read_ref(REPO, "main"), Some(plan.commit.clone()));
    // The token is never sent when there is none; the CDN answered the weights.
    assert!(fake.seen().iter().all(|s| s.auth.is_none()));
    assert_eq!(fake.seen_for("/cdn/").iter().filter(|s| s.method == "GET").count(), 1);

    // A second plan finds everything in the cache; downloading again fetches nothing.
    let again = self::plan(&hub, &cache, "v1");
    assert!(again.files.iter().all(|f| f.local == Local::Complete));
    assert_eq!(again.bytes_to_fetch(), 0);
    fake.clear_seen();
    let (d2, _) = run(&hub, &cache, &again);
    assert!(d2.unwrap().fetched.is_empty());
    assert!(fake.seen().iter().all(|s| s.method != "GET"));

    // Removing what the first run fetched leaves no trace of the repository.
    // Removing what the runs fetched (the journal) leaves no trace of the repository; a blob
    // that another tool downloaded stays.
    let foreign = cache.repo_dir(REPO).join("blobs").join("foreign");
    std::fs::write(&foreign, b"x").unwrap();
    let journal = journal_path(&cache, REPO, &plan.commit);
    assert!(std::fs::read_to_string(&journal).unwrap().contains("blob\t"));
    let removed = remove_journaled(&cache, REPO, &plan.commit, &journal).unwrap();
    assert_eq!((removed.files, removed.bytes), (plan.files.len(), plan.total_bytes()));
    assert!(!journal.exists() && foreign.exists());
    assert!(!cache.snapshot_dir(REPO, &plan.commit).exists());
    assert!(cache.refs(REPO).is_empty(), "{:?}", cache.refs(REPO));
    std::fs::remove_file(&foreign).unwrap();
    remove_journaled(&cache, REPO, &plan.commit, &journal).unwrap();
    assert!(!cache.repo_dir(REPO).exists());
}

#[test]
fn a_dropped_transfer_resumes_with_a_range_request() {
    let fake = hub_with_readme();
    let tmp = tempfile::tempdir().unwrap();
    let cache = HubCache::new(tmp.path());
    let hub = Hub::new(&fake.url, None).unwrap();
    fake.cut("model.safetensors", 300_000, 1);
    let plan = plan(&hub, &cache, "main");
    let (d, log) = run(&hub, &cache, &plan);
    d.unwrap();
    let gets: Vec<_> = fake.seen_for("/cdn/").into_iter().filter(|s| s.method == "GET").collect();
    assert_eq!(gets.len(), 2, "{gets:?}");
    assert_eq!(gets[0].range, None);
    assert_eq!(gets[1].range.as_deref(), Some("bytes=300000-"));
    assert!(log.iter().any(|l| l.contains("broke off") && l.contains("retrying")), "{log:?}");
    assert!(log.iter().any(|l| l.contains("resuming model.safetensors at")), "{log:?}");
    let blob = cache.blob_path(REPO, &sha256(&fake.file("model.safetensors")));
    assert_eq!(std::fs::read(blob).unwrap(), fake.file("model.safetensors"));
}

#[test]
fn a_failed_run_keeps_its_partial_download_for_the_next() {
    let fake = hub_with_readme();
    let tmp = tempfile::tempdir().unwrap();
    let cache = HubCache::new(tmp.path());
    let hub = Hub::new(&fake.url, None).unwrap();
    fake.cut("model.safetensors", 200_000, 100);
    let first = plan(&hub, &cache, "main");
    let (d, _) = run(&hub, &cache, &first);
    let e = format!("{:#}", d.unwrap_err());
    assert!(e.contains("downloading model.safetensors of org/tiny@") && e.contains("failed 3 times in a row"), "{e}");
    assert!(e.contains(".incomplete and the next run resumes from there"), "{e}");
    let sha = sha256(&fake.file("model.safetensors"));
    let part = cache.repo_dir(REPO).join("blobs").join(format!("{sha}.incomplete"));
    assert_eq!(std::fs::metadata(&part).unwrap().len(), 200_000);

    fake.cut("model.safetensors", 0, 0);
    fake.clear_seen();
    let second = plan(&hub, &cache, "main");
    let weights = second.files.iter().find(|f| f.meta.name == "model.safetensors").unwrap();
    assert_eq!(weights.local, Local::Partial(200_000));
    assert_eq!(second.partial_bytes(), 200_000);
    let (d, log) = run(&hub, &cache, &second);
    d.unwrap();
    let gets: Vec<_> = fake.seen_for("/cdn/").into_iter().filter(|s| s.method == "GET").collect();
    assert_eq!(gets.iter().map(|g| g.range.as_deref()).collect::<Vec<_>>(), [Some("bytes=200000-")]);
    assert!(log.iter().any(|l| l.contains("resuming model.safetensors at 195.31 KiB")), "{log:?}");
    assert!(!part.exists());

    // A server that ignores ranges makes the file start over, and it still checks out.
    std::fs::remove_file(cache.blob_path(REPO, &sha)).unwrap();
    std::fs::write(&part, &fake.file("model.safetensors")[..1000]).unwrap();
    fake.ignore_range(true);
    let (d, log) = run(&hub, &cache, &plan(&hub, &cache, "main"));
    d.unwrap();
    assert!(log.iter().any(|l| l.contains("did not resume at byte 1000")), "{log:?}");
    assert_eq!(std::fs::read(cache.blob_path(REPO, &sha)).unwrap(), fake.file("model.safetensors"));
}

#[test]
fn a_corrupt_file_is_refused_and_deleted() {
    let fake = hub_with_readme();
    let tmp = tempfile::tempdir().unwrap();
    let cache = HubCache::new(tmp.path());
    let hub = Hub::new(&fake.url, None).unwrap();
    fake.corrupt("model.safetensors", true);
    let plan = plan(&hub, &cache, "main");
    let (d, _) = run(&hub, &cache, &plan);
    let e = format!("{:#}", d.unwrap_err());
    let sha = sha256(&fake.file("model.safetensors"));
    assert!(e.contains("model.safetensors of org/tiny@") && e.contains("is corrupt: the sha256 of the"), "{e}");
    assert!(e.contains(&format!("the hub says {sha}")) && e.contains("the download was deleted"), "{e}");
    let blobs = cache.repo_dir(REPO).join("blobs");
    assert!(!blobs.join(&sha).exists() && !blobs.join(format!("{sha}.incomplete")).exists());

    // Small files are checked against their git blob id.
    fake.corrupt("model.safetensors", false);
    fake.corrupt("config.json", true);
    let cache = HubCache::new(tmp.path().join("other"));
    let (d, _) = run(&hub, &cache, &self::plan(&hub, &cache, "main"));
    let e = format!("{:#}", d.unwrap_err());
    assert!(e.contains("config.json of org/tiny@") && e.contains("the git blob id of the"), "{e}");
}

#[test]
fn revisions_repositories_and_tokens() {
    let fake = hub_with_readme();
    let open = Hub::new(&fake.url, None).unwrap();
    let e = open.repo_info(&RepoRef::parse("org/tiny@nope").unwrap()).unwrap_err().to_string();
    assert!(
        e.contains("revision nope of org/tiny not found at http://127.0.0.1:") && e.contains("RevisionNotFound"),
        "{e}"
    );
    let e = open.repo_info(&RepoRef::parse("org/other").unwrap()).unwrap_err().to_string();
    assert!(e.contains("repository org/other not found") && e.contains("404"), "{e}");
    let info = open.repo_info(&RepoRef::parse(&format!("org/tiny@{}", fake.commit())).unwrap()).unwrap();
    let missing = cherenkov_hub::Sibling { name: "nope.json".into(), ..Default::default() };
    let e = open.file_meta(REPO, &info.commit, &missing).unwrap_err().to_string();
    assert!(
        e.contains("nope.json of org/tiny at commit") && e.contains("not found") && e.contains("EntryNotFound"),
        "{e}"
    );

    fake.require_token(Some("hf_secret"));
    let e = open.repo_info(&RepoRef::parse(REPO).unwrap()).unwrap_err().to_string();
    assert!(e.contains("org/tiny needs authentication") && e.contains("401") && e.contains("set HF_TOKEN"), "{e}");
    let wrong = Hub::new(&fake.url, Some("hf_wrong".into())).unwrap();
    let e = wrong.repo_info(&RepoRef::parse(REPO).unwrap()).unwrap_err().to_string();
    assert!(e.contains("did not accept the token (HF_TOKEN)"), "{e}");
    let good = Hub::new(&fake.url, Some("hf_secret".into())).unwrap();
    fake.clear_seen();
    let tmp = tempfile::tempdir().unwrap();
    let cache = HubCache::new(tmp.path());
    let plan = plan(&good, &cache, "main");
    let (d, _) = run(&good, &cache, &plan);
    d.unwrap();
    assert!(fake.seen_for("/resolve/").iter().all(|s| s.auth.as_deref() == Some("Bearer hf_secret")));
}
