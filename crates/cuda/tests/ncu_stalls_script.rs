//! `tools/gpu/ncu_stalls.py` on a source-page CSV made up here in the layout Nsight Compute writes
//! (`ncu -i R --page source --print-source sass --csv`): a line before the first table, one table
//! per launch, each with its own header row. Needs `python3` (CI has it).

use std::path::Path;
use std::process::Command;

const HEADER: &str = "\"Address\",\"Source\",\"Warp Stall Sampling (All Samples)\",\"Warp Stall Sampling (Not-issued Samples)\",\"stall_long_sb\",\"stall_long_sb (Not Issued)\",\"stall_no_inst\",\"stall_no_inst (Not Issued)\"";

fn csv() -> String {
    let mut s = String::from("[573] cherenkov@127.0.0.1\n");
    // Launch 0: 4 lines, 10 samples (long_sb 6, no_inst 4).
    s += HEADER;
    s += "\n\"0x0\",\"LDC R1, c[0x0][0x28]\",\"1\",\"1\",\"0\",\"0\",\"1\",\"1\"\n";
    s += "\"0x10\",\"LDG.E.U16.CONSTANT R65, desc[UR22][R16.64]\",\"0\",\"0\",\"0\",\"0\",\"0\",\"0\"\n";
    s += "\"0x20\",\"PRMT R12, R65, 0x5410, R66\",\"6\",\"5\",\"5\",\"4\",\"1\",\"1\"\n";
    s += "\"0x30\",\"IDP.4A.S8.S8 R42, R42, R16, RZ\",\"3\",\"2\",\"1\",\"1\",\"2\",\"1\"\n";
    // Launch 1: 1 line, 1,200 samples (a thousands separator), all no_inst.
    s += HEADER;
    s += "\n\"0x0\",\"BAR.SYNC.DEFER_BLOCKING 0x0\",\"1,200\",\"1,000\",\"0\",\"0\",\"1,200\",\"1,000\"\n";
    s
}

fn run(args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("source.csv");
    std::fs::write(&path, csv()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/gpu/ncu_stalls.py");
    let out = Command::new("python3").arg(script).arg(&path).args(args).output().expect("python3 runs");
    assert!(out.status.success(), "ncu_stalls.py failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

#[test]
fn the_stalls_script_sums_each_launch_by_reason_and_ranks_its_lines() {
    let out = run(&[]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "launch 0: 4 lines, 10 samples", "{out}");
    assert_eq!(lines[1], "  reasons: long_sb 6 (60.0%), no_inst 4 (40.0%)", "{out}");
    // Lines by samples, numbered within the table; the line without samples is left out.
    let ranked: Vec<Vec<&str>> = lines[2..5].iter().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(ranked[0][..3], ["6", "2", "PRMT"], "{out}");
    assert_eq!(ranked[0][ranked[0].len() - 2..], ["long_sb=5", "no_inst=1"], "{out}");
    assert_eq!(ranked[1][..3], ["3", "3", "IDP.4A.S8.S8"], "{out}");
    assert_eq!(ranked[2][..3], ["1", "0", "LDC"], "{out}");
    assert_eq!(lines[5], "launch 1: 1 lines, 1200 samples", "{out}");
    assert_eq!(lines[6], "  reasons: no_inst 1200 (100.0%)", "{out}");
    assert_eq!(lines.len(), 8, "{out}");
}

#[test]
fn the_stalls_script_prints_only_the_top_lines_asked() {
    let out = run(&["1"]);
    let ranked = out.lines().filter(|l| !l.starts_with("launch") && !l.contains("reasons:")).count();
    assert_eq!(ranked, 2, "one line per launch:\n{out}");
    assert!(out.contains(" 2  PRMT") && !out.contains("IDP"), "{out}");
}
