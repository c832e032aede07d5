//! Offline SSD tier tools: `ssd check` verifies every record of every shard file in a
//! directory (headers and payload checksums); `ssd dump` lists the records. Run them on the
//! files of a stopped server (or a copy).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use orbitkv_proto::chunk_checksum;
use orbitkv_proto::ChunkKey;
use orbitkv_ssd::format::{Superblock, SUPERBLOCK_BYTES};
use orbitkv_ssd::log::{RecoveryReport, RegionLog, SsdEntry};
use serde_json::json;

use crate::error::CtlError;

/// One shard file, read.
struct ShardFile {
    path: PathBuf,
    superblock: Superblock,
    log: RegionLog,
    report: RecoveryReport,
    file: File,
}

/// `path`'s failure at `step` (`"reading superblock: "`; empty for opening it).
fn failed<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
    path: &Path,
    step: &str,
) -> impl FnOnce(E) -> CtlError {
    let (path, step) = (path.to_owned(), step.to_owned());
    move |e| CtlError::ShardFile { path, step, source: e.into() }
}

fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, CtlError> {
    let entries =
        std::fs::read_dir(dir).map_err(|source| CtlError::Dir { dir: dir.to_owned(), source })?;
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("shard-") && n.ends_with(".okv"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(CtlError::NoShardFiles(dir.to_owned()));
    }
    Ok(files)
}

fn open(path: &Path) -> Result<ShardFile, CtlError> {
    let file = File::open(path).map_err(failed(path, ""))?;
    let mut block = vec![0u8; SUPERBLOCK_BYTES as usize];
    file.read_exact_at(&mut block, 0).map_err(failed(path, "reading superblock: "))?;
    let superblock = Superblock::decode(&block).map_err(failed(path, "superblock: "))?;
    let (log, report) = RegionLog::recover(superblock, |at, buf| file.read_exact_at(buf, at))
        .map_err(failed(path, "scanning records: "))?;
    Ok(ShardFile { path: path.to_owned(), superblock, log, report, file })
}

fn hex(key: &ChunkKey) -> String {
    key.digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn payload_ok(f: &ShardFile, e: &SsdEntry) -> Result<bool, CtlError> {
    let mut buf = vec![0u8; e.len as usize];
    let step = format!("reading payload at {}: ", e.payload_offset());
    f.file.read_exact_at(&mut buf, e.payload_offset()).map_err(failed(&f.path, &step))?;
    Ok(chunk_checksum(&buf) == e.checksum)
}

/// `ssd check`: exit status 0 only if every header and every payload checks out.
pub fn check(dir: &Path, json_out: bool) -> Result<bool, CtlError> {
    let mut all_ok = true;
    let mut shards = Vec::new();
    for path in shard_files(dir)? {
        let f = open(&path)?;
        let mut bad_payloads = 0u64;
        for (_, e) in f.log.iter() {
            if !payload_ok(&f, e)? {
                bad_payloads += 1;
            }
        }
        let ok = bad_payloads == 0 && f.report.dropped == 0;
        all_ok &= ok;
        shards.push(json!({
            "file": path.display().to_string(),
            "shard": f.superblock.shard_id,
            "shard_count": f.superblock.shard_count,
            "regions": f.superblock.region_count,
            "region_bytes": f.superblock.region_bytes,
            "records": f.log.len(),
            "superseded": f.report.superseded,
            "torn_headers": f.report.dropped,
            "bad_payloads": bad_payloads,
            "used_bytes": f.log.used_bytes(),
            "ok": ok,
        }));
    }
    if json_out {
        println!("{}", json!({"ok": all_ok, "files": shards}));
    } else {
        for s in &shards {
            println!(
                "{}: shard {}/{}, {} records, {} superseded, {} torn headers, {} bad payloads: {}",
                s["file"].as_str().unwrap_or(""),
                s["shard"],
                s["shard_count"],
                s["records"],
                s["superseded"],
                s["torn_headers"],
                s["bad_payloads"],
                if s["ok"] == true { "ok" } else { "CORRUPT" }
            );
        }
    }
    Ok(all_ok)
}

/// `ssd dump`: one line (or JSON object) per live record.
pub fn dump(dir: &Path, json_out: bool) -> Result<(), CtlError> {
    for path in shard_files(dir)? {
        let f = open(&path)?;
        let mut records: Vec<(&ChunkKey, &SsdEntry)> = f.log.iter().collect();
        records.sort_by_key(|(_, e)| e.sequence);
        for (key, e) in records {
            if json_out {
                println!(
                    "{}",
                    json!({"shard": f.superblock.shard_id, "namespace": format!("{:#018x}", key.namespace),
                           "digest": hex(key), "len": e.len, "checksum": format!("{:#018x}", e.checksum),
                           "sequence": e.sequence, "region": e.region, "offset": e.offset})
                );
            } else {
                println!(
                    "shard {} seq {:>8} region {:>4} offset {:>12} len {:>10} ns {:#018x} {}",
                    f.superblock.shard_id,
                    e.sequence,
                    e.region,
                    e.offset,
                    e.len,
                    key.namespace,
                    hex(key)
                );
            }
        }
    }
    Ok(())
}
