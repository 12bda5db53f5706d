//! Bounded listeners: every socket the agent accepts on has a connection cap
//! and, where a connection can sit idle for good, an idle timeout.
//!
//! Without them a client (or an attacker) that opens connections and sends
//! nothing took the agent to its file-descriptor limit: `/healthz` stopped
//! answering (so Kubernetes restarted the agent) and accept errors spun a
//! core. With a cap below the descriptor limit accept never fails that way,
//! and a full listener waits for a connection to close instead of failing.
//!
//! The caps must not become the lockout themselves: one peer (on a Unix
//! socket its pod, or its uid outside any pod; on TCP its address) and one
//! process hold at most a share of them, refused at accept so that their
//! surplus never queues ahead of others; an ingest connection that holds no
//! stream is closed after a short grace. Every refusal and close is counted
//! by listener and reason.
//!
//! An ingest connection, and each of its streams, also holds an estimate of
//! the buffers its peer can make the agent fill, drawn from the agent's one
//! memory budget ([`ConnectionMemory`]); one the budget cannot cover is
//! refused like one over a share.

use std::collections::HashMap;
use std::future::Future as _;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// A listener that holds at most `max` connections at once; past that,
/// accepting waits until one closes. Accept errors are handled (logged,
/// backed off) by axum's listener implementations underneath.
pub struct Limited<L> {
    inner: L,
    permits: Arc<Semaphore>,
    idle_timeout: Option<Duration>,
    /// Per-peer and per-process shares of the cap (None: no shares).
    quota: Option<Arc<PeerQuota>>,
    /// Where a Unix socket peer's pod is looked up (`--proc-root`; None:
    /// peers are told apart by uid).
    proc_root: Option<PathBuf>,
    /// The memory budget each connection draws its buffers from (ingest).
    memory: Option<Arc<ConnectionMemory>>,
    /// How long a connection may hold no stream (ingest listeners only).
    no_stream_grace: Option<Duration>,
    closes: Option<Closes>,
}

/// The listeners `stepwatch_connections_closed_total` names.
pub const LISTENERS: &[&str] = &[
    "http",
    "api",
    "ingest_socket",
    "ingest_tcp",
    "ingest_volume",
];

/// The reasons `stepwatch_connections_closed_total` counts.
pub const CLOSE_REASONS: &[&str] = &[
    "peer_limit",
    "process_limit",
    "first_byte_timeout",
    "idle_timeout",
    "header_timeout",
    "no_stream",
    "memory_budget",
];

/// Counts a listener's refused and closed connections.
#[derive(Clone)]
pub struct Closes {
    pub counter: prometheus::IntCounterVec,
    pub listener: &'static str,
}

impl Closes {
    pub fn count(&self, reason: &'static str) {
        debug_assert!(CLOSE_REASONS.contains(&reason), "{reason} is not listed");
        self.counter
            .with_label_values(&[self.listener, reason])
            .inc();
    }
}

/// Who is on the other end of a connection, for [`PeerQuota`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PeerKey {
    /// A Unix socket peer's pod (its UID), from the cgroup of the peer's
    /// PID (SO_PEERCRED) as pod attribution reads it: pods that all run as
    /// root must not share one share.
    Pod(Arc<str>),
    /// A Unix socket peer's user (SO_PEERCRED), when its pod is not known
    /// (a process in no pod, or outside the agent's PID namespace).
    Uid(u32),
    /// A TCP peer's address.
    Addr(IpAddr),
    /// A Unix socket peer's process, when its PID is visible here.
    Pid(u32),
}

impl PeerKey {
    /// The reason a refusal for this key is counted under.
    pub fn refusal(&self) -> &'static str {
        match self {
            PeerKey::Pid(_) => "process_limit",
            _ => "peer_limit",
        }
    }
}

/// The quota keys of an accepted connection: its peer and, on a Unix
/// socket, its process.
pub trait PeerOf {
    /// `proc_root` is where a Unix socket peer's pod is looked up (None:
    /// by uid only).
    fn peer_keys(&self, proc_root: Option<&Path>) -> Vec<PeerKey>;
}

impl PeerOf for tokio::net::UnixStream {
    fn peer_keys(&self, proc_root: Option<&Path>) -> Vec<PeerKey> {
        let Ok(cred) = self.peer_cred() else {
            return Vec::new();
        };
        // PID 0: the peer is outside our PID namespace; its uid still counts.
        let pid = cred
            .pid()
            .and_then(|p| u32::try_from(p).ok())
            .filter(|&p| p != 0);
        let pod = proc_root
            .zip(pid)
            .and_then(|(root, pid)| crate::workload::pod_uid_of(root, pid));
        let mut keys = vec![match pod {
            Some(uid) => PeerKey::Pod(uid.into()),
            None => PeerKey::Uid(cred.uid()),
        }];
        keys.extend(pid.map(PeerKey::Pid));
        keys
    }
}

impl PeerOf for tokio::net::TcpStream {
    fn peer_keys(&self, _proc_root: Option<&Path>) -> Vec<PeerKey> {
        self.peer_addr()
            .map(|a| vec![PeerKey::Addr(a.ip())])
            .unwrap_or_default()
    }
}

/// How many connections (or streams) each peer and each process holds,
/// against a limit for each: one peer or process cannot take every slot of
/// a cap shared with others.
pub struct PeerQuota {
    /// Most held by one peer (a uid or an address).
    per_peer: usize,
    /// Most held by one process.
    per_process: usize,
    held: Mutex<HashMap<PeerKey, usize>>,
}

impl PeerQuota {
    pub fn new(per_peer: usize, per_process: usize) -> Arc<Self> {
        Arc::new(Self {
            per_peer,
            per_process,
            held: Mutex::new(HashMap::new()),
        })
    }

    fn limit(&self, key: &PeerKey) -> usize {
        match key {
            PeerKey::Pid(_) => self.per_process,
            _ => self.per_peer,
        }
    }

    /// Takes one slot under every key, or none: Err names the first key
    /// at its limit.
    pub fn try_take(self: &Arc<Self>, keys: Vec<PeerKey>) -> Result<PeerSlot, PeerKey> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(full) = keys
            .iter()
            .find(|k| held.get(*k).copied().unwrap_or(0) >= self.limit(k))
        {
            return Err(full.clone());
        }
        for k in &keys {
            *held.entry(k.clone()).or_insert(0) += 1;
        }
        Ok(PeerSlot {
            quota: Arc::clone(self),
            keys,
        })
    }
}

/// One connection's (or stream's) share of a [`PeerQuota`], given back on drop.
pub struct PeerSlot {
    quota: Arc<PeerQuota>,
    keys: Vec<PeerKey>,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut held = self.quota.held.lock().unwrap_or_else(|e| e.into_inner());
        for k in &self.keys {
            if let Some(n) = held.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    held.remove(k);
                }
            }
        }
    }
}

/// HTTP/2's connection window on ingest connections: the most its peer
/// may send that the agent has not read.
pub const CONNECTION_WINDOW: u32 = 64 << 10;

/// HTTP/2's largest frame on ingest connections.
pub const MAX_FRAME: u32 = 16 << 10;

/// What one ingest connection can make the agent hold, whatever its peer
/// does: the connection window (data sent and not yet read, on all its
/// streams together), the codec's read and write buffers (a frame each),
/// and as much again for HTTP/2's and TLS's connection state.
pub const CONNECTION_BYTES: u64 = CONNECTION_WINDOW as u64 + 4 * MAX_FRAME as u64;

/// The connections' and streams' share of the agent's memory budget
/// (`crate::memory::MemoryBudget::connections_bytes`): each open one holds
/// an estimate of its buffers. A new one is refused when the budget cannot
/// cover it, or when its peer (keyed as by [`PeerQuota`]) would hold more
/// than half the budget, so that a peer at its caps leaves others room.
#[derive(Debug)]
pub struct ConnectionMemory {
    budget: u64,
    held: Mutex<MemoryHolders>,
}

#[derive(Debug, Default)]
struct MemoryHolders {
    total: u64,
    by_peer: HashMap<PeerKey, u64>,
}

impl ConnectionMemory {
    pub fn new(budget: u64) -> Arc<Self> {
        Arc::new(Self {
            budget,
            held: Mutex::default(),
        })
    }

    /// `bytes` for the peer of `keys` (the first key, its pod, uid or
    /// address), or None when the budget or the peer's half of it cannot
    /// cover them.
    pub fn try_take(self: &Arc<Self>, keys: &[PeerKey], bytes: u64) -> Option<MemoryTaken> {
        let peer = keys
            .first()
            .filter(|k| !matches!(k, PeerKey::Pid(_)))
            .cloned();
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let peer_held = peer
            .as_ref()
            .and_then(|p| held.by_peer.get(p))
            .copied()
            .unwrap_or(0);
        if held.total + bytes > self.budget || peer_held + bytes > self.budget / 2 {
            return None;
        }
        held.total += bytes;
        if let Some(p) = &peer {
            *held.by_peer.entry(p.clone()).or_insert(0) += bytes;
        }
        Some(MemoryTaken {
            memory: Arc::clone(self),
            peer,
            bytes,
        })
    }

    #[cfg(test)]
    fn held(&self) -> u64 {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).total
    }
}

/// A connection's (or stream's) bytes of a [`ConnectionMemory`], given back
/// on drop.
pub struct MemoryTaken {
    memory: Arc<ConnectionMemory>,
    peer: Option<PeerKey>,
    bytes: u64,
}

impl Drop for MemoryTaken {
    fn drop(&mut self) {
        let mut held = self.memory.held.lock().unwrap_or_else(|e| e.into_inner());
        held.total -= self.bytes;
        if let Some(p) = &self.peer {
            if let Some(n) = held.by_peer.get_mut(p) {
                *n -= self.bytes;
                if *n == 0 {
                    held.by_peer.remove(p);
                }
            }
        }
    }
}

/// The streams open on one connection; the ingest service counts them
/// (from [`ConnInfo`]) so that the connection can tell when it holds none.
#[derive(Clone, Default)]
pub struct ConnStreams(Arc<ConnStreamsInner>);

#[derive(Default)]
struct ConnStreamsInner {
    open: AtomicUsize,
    /// The connection's reader, woken when its last stream ends.
    waker: AtomicWaker,
}

impl ConnStreams {
    /// Counts a stream open until the guard drops.
    pub fn opened(&self) -> StreamOnConn {
        self.0.open.fetch_add(1, Ordering::SeqCst);
        StreamOnConn(self.clone())
    }

    fn open(&self) -> usize {
        self.0.open.load(Ordering::SeqCst)
    }
}

/// A stream counted on its connection until dropped.
pub struct StreamOnConn(ConnStreams);

impl Drop for StreamOnConn {
    fn drop(&mut self) {
        if self.0 .0.open.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0 .0.waker.wake();
        }
    }
}

/// What tonic puts in a request's extensions for a [`LimitedIo`]: the
/// underlying connection's info, its stream count and its quota keys.
#[derive(Clone)]
pub struct ConnInfo<C> {
    pub inner: C,
    pub streams: ConnStreams,
    /// Who the connection is from, as its listener's quota counted it.
    pub keys: Vec<PeerKey>,
}

/// How long a new connection may stay silent before its first byte: a
/// client sends its request (or HTTP/2 preface) at once, and connections
/// that never do must not hold a slot for the whole idle timeout (a flood
/// of them once locked ranks out for minutes).
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(5);

impl<L> Limited<L> {
    /// Wraps `inner`; `idle_timeout` closes a connection that neither reads
    /// nor writes for that long (None: never).
    pub fn new(inner: L, max: usize, idle_timeout: Option<Duration>) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max)),
            idle_timeout,
            quota: None,
            proc_root: None,
            memory: None,
            no_stream_grace: None,
            closes: None,
        }
    }

    /// Refuses a connection at accept when its peer or process holds its
    /// share of the cap already.
    pub fn per_peer(mut self, quota: Arc<PeerQuota>) -> Self {
        self.quota = Some(quota);
        self
    }

    /// Tells Unix socket peers apart by their pod, looked up under
    /// `proc_root`, where they are in one.
    pub fn pods_under(mut self, proc_root: PathBuf) -> Self {
        self.proc_root = Some(proc_root);
        self
    }

    /// Draws each connection's [`CONNECTION_BYTES`] from `memory`, and
    /// refuses one it cannot cover.
    pub fn drawing_from(mut self, memory: Arc<ConnectionMemory>) -> Self {
        self.memory = Some(memory);
        self
    }

    /// Closes a connection that holds no stream for `grace` (ingest).
    pub fn no_stream_grace(mut self, grace: Duration) -> Self {
        self.no_stream_grace = Some(grace);
        self
    }

    /// Counts refusals and closes under `closes`.
    pub fn counted(mut self, closes: Closes) -> Self {
        self.closes = Some(closes);
        self
    }
}

impl<L> axum::serve::Listener for Limited<L>
where
    L: axum::serve::Listener,
    L::Io: PeerOf,
{
    type Io = LimitedIo<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        loop {
            let (io, addr) = self.inner.accept().await;
            let keys = io.peer_keys(self.proc_root.as_deref());
            let slot = match &self.quota {
                None => None,
                Some(quota) => match quota.try_take(keys.clone()) {
                    Ok(slot) => Some(slot),
                    // Closed at once: a peer's surplus must not wait in the
                    // backlog ahead of everyone else's connections.
                    Err(full) => {
                        tracing::debug!(peer = ?full, "refused a connection: its peer holds its share of the listener");
                        if let Some(c) = &self.closes {
                            c.count(full.refusal());
                        }
                        continue;
                    }
                },
            };
            let memory = match &self.memory {
                None => None,
                Some(memory) => match memory.try_take(&keys, CONNECTION_BYTES) {
                    Some(held) => Some(held),
                    None => {
                        tracing::debug!(peer = ?keys.first(), "refused a connection: the memory budget for connections cannot cover it");
                        if let Some(c) = &self.closes {
                            c.count("memory_budget");
                        }
                        continue;
                    }
                },
            };
            let io = LimitedIo::new(io, permit, self.idle_timeout, (slot, memory), keys)
                .with_grace(self.no_stream_grace, self.closes.clone());
            return (io, addr);
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

impl<L> Limited<L>
where
    L: axum::serve::Listener,
    L::Io: PeerOf,
{
    /// The connections as a stream, for tonic's `serve_with_incoming`.
    pub fn into_incoming(self) -> impl Stream<Item = io::Result<LimitedIo<L::Io>>> + Send {
        futures_util::stream::unfold(self, |mut listener| async move {
            let (io, _) = axum::serve::Listener::accept(&mut listener).await;
            Some((Ok(io), listener))
        })
    }
}

/// A connection that gives its slot back when dropped.
pub struct LimitedIo<T> {
    inner: T,
    _permit: OwnedSemaphorePermit,
    /// Its share of the peer quota and of the memory budget.
    _held: (Option<PeerSlot>, Option<MemoryTaken>),
    keys: Vec<PeerKey>,
    idle: Option<(Duration, Pin<Box<Sleep>>)>,
    /// Whether the peer has sent a byte; until then the deadline is
    /// [`FIRST_BYTE_TIMEOUT`] and only its bytes move it.
    heard: bool,
    streams: ConnStreams,
    /// The no-stream grace and its timer, armed while no stream is open.
    grace: Option<(Duration, Pin<Box<Sleep>>, bool)>,
    closes: Option<Closes>,
    /// Set once the close was counted (a failed read may be polled again).
    closed: bool,
}

impl<T> LimitedIo<T> {
    fn new(
        inner: T,
        permit: OwnedSemaphorePermit,
        idle_timeout: Option<Duration>,
        held: (Option<PeerSlot>, Option<MemoryTaken>),
        keys: Vec<PeerKey>,
    ) -> Self {
        let first = idle_timeout.map(|d| d.min(FIRST_BYTE_TIMEOUT));
        Self {
            inner,
            _permit: permit,
            _held: held,
            keys,
            idle: idle_timeout
                .zip(first)
                .map(|(d, f)| (d, Box::pin(tokio::time::sleep(f)))),
            heard: false,
            streams: ConnStreams::default(),
            grace: None,
            closes: None,
            closed: false,
        }
    }

    fn with_grace(mut self, grace: Option<Duration>, closes: Option<Closes>) -> Self {
        self.grace = grace.map(|g| (g, Box::pin(tokio::time::sleep(g)), false));
        self.closes = closes;
        self
    }

    /// Fails with `reason`, counted once.
    fn close(&mut self, reason: &'static str, why: &'static str) -> io::Error {
        if !std::mem::replace(&mut self.closed, true) {
            if let Some(c) = &self.closes {
                c.count(reason);
            }
        }
        io::Error::new(io::ErrorKind::TimedOut, why)
    }

    /// Fails once the connection has held no stream for the grace.
    fn check_grace(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let Some((grace, sleep, armed)) = &mut self.grace else {
            return Ok(());
        };
        self.streams.0.waker.register(cx.waker());
        if self.streams.open() > 0 {
            *armed = false;
            return Ok(());
        }
        if !*armed {
            sleep.as_mut().reset(Instant::now() + *grace);
            *armed = true;
        }
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                Err(self.close("no_stream", "connection held no stream past the grace"))
            }
            Poll::Pending => Ok(()),
        }
    }

    /// Restarts the idle clock after progress (before the peer's first
    /// byte, only its bytes count); fails once it ran out while the
    /// connection waited.
    fn check_idle(&mut self, cx: &mut Context<'_>, progressed: bool, read: bool) -> io::Result<()> {
        if progressed && read {
            self.heard = true;
        }
        let heard = self.heard;
        let Some((timeout, sleep)) = &mut self.idle else {
            return Ok(());
        };
        if progressed && heard {
            sleep.as_mut().reset(Instant::now() + *timeout);
            return Ok(());
        }
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) if heard => {
                Err(self.close("idle_timeout", "connection idle past the timeout"))
            }
            Poll::Ready(()) => Err(self.close(
                "first_byte_timeout",
                "connection sent nothing within the first-byte timeout",
            )),
            Poll::Pending => Ok(()),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for LimitedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        let got_bytes = matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before;
        self.check_idle(cx, poll.is_ready(), got_bytes)?;
        self.check_grace(cx)?;
        poll
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for LimitedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.check_idle(cx, poll.is_ready(), false)?;
        poll
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for LimitedIo<T> {
    type ConnectInfo = ConnInfo<T::ConnectInfo>;

    fn connect_info(&self) -> Self::ConnectInfo {
        ConnInfo {
            inner: self.inner.connect_info(),
            streams: self.streams.clone(),
            keys: self.keys.clone(),
        }
    }
}

/// Raises this process's open-file limit to its hard limit, so the caps
/// above, not the default soft limit (often 1024), are what binds. Returns
/// the (old, new) soft limit, or the error.
pub fn raise_fd_limit() -> io::Result<(u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let old = limit.rlim_cur;
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: as above; raising the soft limit up to the hard one needs
        // no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok((old, limit.rlim_cur))
}

/// The bounds every ingest listener's connections share (flags of the same
/// names); each listener counts its peers apart.
#[derive(Clone, Debug)]
pub struct IngestConnections {
    pub idle_timeout: Option<Duration>,
    /// `--connection-grace`.
    pub grace: Duration,
    /// `--max-connections-per-peer`.
    pub per_peer: usize,
    /// `--max-connections-per-process`.
    pub per_process: usize,
    /// `--proc-root`: where peers' pods are looked up.
    pub proc_root: PathBuf,
    /// What connections and streams draw their buffers from.
    pub memory: Arc<ConnectionMemory>,
    /// `stepwatch_connections_closed_total`.
    pub counter: prometheus::IntCounterVec,
}

impl IngestConnections {
    /// `inner` bounded to `max` connections, with the per-peer shares, the
    /// no-stream grace, and counts under `listener`.
    pub fn limit<L>(&self, inner: L, max: usize, listener: &'static str) -> Limited<L> {
        Limited::new(inner, max, self.idle_timeout)
            .per_peer(PeerQuota::new(self.per_peer, self.per_process))
            .pods_under(self.proc_root.clone())
            .drawing_from(Arc::clone(&self.memory))
            .no_stream_grace(self.grace)
            .counted(Closes {
                counter: self.counter.clone(),
                listener,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_peer_holds_at_most_half_the_connection_memory_and_gives_it_back() {
        let memory = ConnectionMemory::new(1000);
        let pod = |uid: &str| vec![PeerKey::Pod(uid.into()), PeerKey::Pid(7)];
        let a = memory.try_take(&pod("a"), 300).expect("room");
        let a2 = memory.try_take(&pod("a"), 200).expect("half, exactly");
        assert!(memory.try_take(&pod("a"), 1).is_none(), "past its half");
        let b = memory.try_take(&pod("b"), 500).expect("another pod's half");
        assert!(
            memory.try_take(&[PeerKey::Uid(0)], 1).is_none(),
            "the budget is spent"
        );
        drop(a);
        let c = memory
            .try_take(&[PeerKey::Uid(0)], 300)
            .expect("room given back");
        assert_eq!(memory.held(), 1000);
        drop((a2, b, c));
        assert_eq!(memory.held(), 0);
        assert!(memory.held.lock().unwrap().by_peer.is_empty());
    }
}
