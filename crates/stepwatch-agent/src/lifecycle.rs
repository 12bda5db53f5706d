//! What one agent owns on disk and how it lets go: a lock beside the
//! marker socket (one agent per socket path), the socket file itself (only
//! its owner unlinks it), and files written whole or not at all.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

/// An exclusive `flock` on `<socket>.lock`, held for the agent's life (the
/// kernel drops it when the process exits, however it exits). A second
/// agent on the same socket path waits for it, up to `--lock-wait`, then
/// refuses to start: before it, a new agent started while the old one shut
/// down replaced the socket, and the old one's exit unlinked the new file.
pub struct SocketLock {
    _file: File,
    path: PathBuf,
}

impl SocketLock {
    /// The lock file's path for the marker socket `socket`.
    pub fn path_for(socket: &Path) -> PathBuf {
        let mut path = socket.as_os_str().to_owned();
        path.push(".lock");
        PathBuf::from(path)
    }

    /// Takes the lock of `socket`, waiting up to `wait` for an agent that
    /// holds it (one shutting down) to exit. The holder's PID is written in
    /// the file for the error message.
    pub fn acquire(socket: &Path, wait: Duration) -> anyhow::Result<Self> {
        let path = Self::path_for(socket);
        crate::create_parent_dir(&path, "socket")?;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("cannot open the lock file {}", path.display()))?;
        let deadline = Instant::now() + wait;
        let mut logged = false;
        loop {
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                break;
            }
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(err).with_context(|| format!("cannot lock {}", path.display()));
            }
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = holder.trim();
            if Instant::now() >= deadline {
                anyhow::bail!(
                    "another stepwatch agent (pid {holder}) holds {} and owns the socket {}; \
                     stop it, or pass another --socket (waited {:?}, --lock-wait)",
                    path.display(),
                    socket.display(),
                    wait
                );
            }
            if !logged {
                tracing::warn!(lock = %path.display(), holder_pid = holder, wait = ?wait, "another agent holds the socket's lock; waiting for it to exit");
                logged = true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        file.set_len(0)?;
        writeln!(file, "{}", std::process::id())?;
        Ok(Self { _file: file, path })
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A socket file this agent bound: removed at exit only while the path
/// still names that same file (device and inode), never one another agent
/// bound there since.
pub struct OwnedSocket {
    path: PathBuf,
    identity: Option<(u64, u64)>,
}

impl OwnedSocket {
    /// Remembers the file now at `path`, just bound.
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            identity: file_identity(path),
        }
    }

    /// Unlinks the socket if it is still the one this agent bound; says
    /// which it did in the log.
    pub fn remove(&self) {
        match file_identity(&self.path) {
            Some(now) if Some(now) == self.identity => {
                let _ = std::fs::remove_file(&self.path);
            }
            Some(_) => {
                tracing::warn!(socket = %self.path.display(), "the socket file is no longer the one this agent bound; leaving it")
            }
            None => {}
        }
    }
}

fn file_identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Writes `path` whole or not at all: `write` fills a temporary file beside
/// it, which is fsynced and renamed over `path`, and the directory is
/// fsynced so the rename survives a crash. On any error (a full disk) the
/// temporary file is removed, so a failed write leaves nothing behind.
pub fn write_atomically_with(
    path: &Path,
    write: impl FnOnce(&mut io::BufWriter<&mut File>) -> io::Result<()>,
) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let mut file = File::create(&tmp)?;
        let mut writer = io::BufWriter::new(&mut file);
        write(&mut writer)?;
        writer.flush()?;
        drop(writer);
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    sync_parent_dir(path)
}

/// Fsyncs the directory holding `path`, so a rename into it is durable.
pub fn sync_parent_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// Most corrupt files kept beside one journal (`.corrupt`, `.corrupt.1` …);
/// past it the newest slot is reused, so corrupt journals cannot fill a disk.
pub const MAX_KEPT_ASIDE: u32 = 10;

/// Moves `path` to the first free name of `<path minus extension>.<ext>`,
/// `.<ext>.1`, … (at most [`MAX_KEPT_ASIDE`]; the last is overwritten when
/// all are taken), then fsyncs the directory. Returns where it went.
pub fn move_aside(path: &Path, ext: &str) -> io::Result<PathBuf> {
    let first = path.with_extension(ext);
    let candidates = std::iter::once(first.clone()).chain((1..MAX_KEPT_ASIDE).map(|n| {
        let mut p = first.as_os_str().to_owned();
        p.push(format!(".{n}"));
        PathBuf::from(p)
    }));
    let mut target = first.clone();
    for candidate in candidates {
        target = candidate;
        if std::fs::symlink_metadata(&target).is_err() {
            break;
        }
    }
    std::fs::rename(path, &target)?;
    sync_parent_dir(path)?;
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_socket_is_refused_with_the_holders_pid() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let held = SocketLock::acquire(&socket, Duration::ZERO).unwrap();
        // flock locks belong to the open file description: a second open
        // in this process conflicts as another process's would.
        let err = SocketLock::acquire(&socket, Duration::from_millis(100))
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("another stepwatch agent"), "{err}");
        assert!(err.contains(&std::process::id().to_string()), "{err}");
        drop(held);
        SocketLock::acquire(&socket, Duration::ZERO).expect("free once the holder let go");
    }

    #[test]
    fn only_the_socket_this_agent_bound_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        std::fs::write(&path, "first").unwrap();
        let owned = OwnedSocket::new(&path);
        // Another agent replaced the file meanwhile (both exist at once,
        // so the new one cannot reuse the old one's inode).
        std::fs::write(dir.path().join("other"), "x").unwrap();
        std::fs::rename(dir.path().join("other"), &path).unwrap();
        owned.remove();
        assert!(path.exists(), "someone else's file stays");
        let mine = OwnedSocket::new(&path);
        mine.remove();
        assert!(!path.exists());
    }

    #[test]
    fn a_failed_write_leaves_no_temporary_file_and_the_old_file_intact() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.json");
        std::fs::write(&path, "old").unwrap();
        // The temporary file lands on a full disk.
        std::os::unix::fs::symlink("/dev/full", dir.path().join("journal.json.tmp")).unwrap();
        let err = write_atomically_with(&path, |w| w.write_all(&[b'x'; 1 << 16])).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        assert!(!dir.path().join("journal.json.tmp").exists());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn corrupt_files_moved_aside_keep_distinct_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.json");
        let mut kept = Vec::new();
        for n in 0..3 {
            std::fs::write(&path, format!("bad {n}")).unwrap();
            kept.push(move_aside(&path, "corrupt").unwrap());
        }
        let names: Vec<_> = kept
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            names,
            ["journal.corrupt", "journal.corrupt.1", "journal.corrupt.2"]
        );
        for (n, p) in kept.iter().enumerate() {
            assert_eq!(std::fs::read_to_string(p).unwrap(), format!("bad {n}"));
        }
    }
}
