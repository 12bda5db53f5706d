//! Bounded listeners: every socket the agent accepts on has a connection cap
//! and, where a connection can sit idle for good, an idle timeout.
//!
//! Without them a client (or an attacker) that opens connections and sends
//! nothing took the agent to its file-descriptor limit: `/healthz` stopped
//! answering (so Kubernetes restarted the agent) and accept errors spun a
//! core. With a cap below the descriptor limit accept never fails that way,
//! and a full listener waits for a connection to close instead of failing.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

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
        }
    }
}

impl<L: axum::serve::Listener> axum::serve::Listener for Limited<L> {
    type Io = LimitedIo<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (io, addr) = self.inner.accept().await;
        (LimitedIo::new(io, permit, self.idle_timeout), addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

impl<L: axum::serve::Listener> Limited<L> {
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
    idle: Option<(Duration, Pin<Box<Sleep>>)>,
    /// Whether the peer has sent a byte; until then the deadline is
    /// [`FIRST_BYTE_TIMEOUT`] and only its bytes move it.
    heard: bool,
}

impl<T> LimitedIo<T> {
    fn new(inner: T, permit: OwnedSemaphorePermit, idle_timeout: Option<Duration>) -> Self {
        let first = idle_timeout.map(|d| d.min(FIRST_BYTE_TIMEOUT));
        Self {
            inner,
            _permit: permit,
            idle: idle_timeout
                .zip(first)
                .map(|(d, f)| (d, Box::pin(tokio::time::sleep(f)))),
            heard: false,
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
            Poll::Ready(()) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection idle past the timeout",
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
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
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
