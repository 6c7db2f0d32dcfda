//! A Prometheus endpoint for a server's counters: `GET /metrics` over plain HTTP/1.1 on
//! an address of the operator's choosing (`--metrics HOST:PORT`), answered with the text
//! exposition format from a snapshot the server renders per scrape. It serves nothing
//! else and holds no state: a scrape reads counters the server keeps anyway.
//!
//! Bad input is bounded: a request head larger than 8 KiB, or not complete within
//! five seconds, is dropped; anything but `GET /metrics` gets 404 or 405. At most
//! eight connections are served at once (more wait to be accepted), and a render is
//! reused for a second: a flood of scrapes costs the server at most one render a
//! second, whatever locks rendering takes.

use std::fmt::Write as _;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MAX_HEAD: usize = 8192;
const READ_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_CONNECTIONS: usize = 8;
const RENDER_REUSE: Duration = Duration::from_secs(1);

/// The last render and when it was made.
type Cache = std::sync::Mutex<Option<(std::time::Instant, Arc<String>)>>;

/// What a metric is, for its `# TYPE` line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    /// A value whose kind the server does not know (a module's counters, some of
    /// which rise and fall).
    Untyped,
}

/// One scrape's text, built metric by metric.
#[derive(Default)]
pub struct Exposition {
    text: String,
}

impl Exposition {
    pub fn new() -> Exposition {
        Exposition::default()
    }

    /// A metric without labels.
    pub fn metric(&mut self, name: &str, kind: Kind, help: &str, value: f64) {
        self.family(name, kind, help, &[(&[], value)]);
    }

    /// A metric with one sample per label set.
    pub fn family(
        &mut self,
        name: &str,
        kind: Kind,
        help: &str,
        samples: &[(&[(&str, &str)], f64)],
    ) {
        let name = metric_name(name);
        let kind = match kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Untyped => "untyped",
        };
        let _ = writeln!(
            self.text,
            "# HELP {name} {}",
            help.replace('\\', "\\\\").replace('\n', "\\n")
        );
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            self.text.push_str(&name);
            if !labels.is_empty() {
                self.text.push('{');
                for (i, (k, v)) in labels.iter().enumerate() {
                    if i > 0 {
                        self.text.push(',');
                    }
                    let v = v
                        .replace('\\', "\\\\")
                        .replace('"', "\\\"")
                        .replace('\n', "\\n");
                    let _ = write!(self.text, "{}=\"{v}\"", metric_name(k));
                }
                self.text.push('}');
            }
            let _ = writeln!(self.text, " {}", number(*value));
        }
    }

    pub fn finish(self) -> String {
        self.text
    }
}

/// A name Prometheus accepts: `[a-zA-Z_:][a-zA-Z0-9_:]*`, anything else as `_`.
pub fn metric_name(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() || out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out
}

fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// Serves `GET /metrics` on `listener` until `stop` resolves; `render` makes a scrape's
/// text (on a blocking thread: it may take locks), at most once a second.
pub async fn serve<F>(
    listener: tokio::net::TcpListener,
    render: F,
    stop: impl Future<Output = ()> + Send,
) where
    F: Fn() -> String + Send + Sync + 'static,
{
    let render = Arc::new(render);
    let cache: Arc<Cache> = Arc::default();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(stop);
    loop {
        let slot = tokio::select! {
            _ = &mut stop => return,
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => return,
            },
        };
        tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => {
                let Ok((conn, _)) = accepted else {
                    // Out of descriptors, say: wait a little rather than spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let (render, cache) = (render.clone(), cache.clone());
                tokio::spawn(async move {
                    let _ = answer(conn, render, cache).await;
                    drop(slot);
                });
            }
        }
    }
}

/// The text to answer with: the cached render if it is fresh, a new one otherwise.
async fn rendered<F>(render: Arc<F>, cache: Arc<Cache>) -> Option<Arc<String>>
where
    F: Fn() -> String + Send + Sync + 'static,
{
    tokio::task::spawn_blocking(move || {
        // Held while rendering: concurrent scrapes wait for one render, not make one each.
        let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, text)) = c.as_ref() {
            if at.elapsed() < RENDER_REUSE {
                return text.clone();
            }
        }
        let text = Arc::new(render());
        *c = Some((std::time::Instant::now(), text.clone()));
        text
    })
    .await
    .ok()
}

async fn answer<F>(
    mut conn: tokio::net::TcpStream,
    render: Arc<F>,
    cache: Arc<Cache>,
) -> std::io::Result<()>
where
    F: Fn() -> String + Send + Sync + 'static,
{
    let mut head = Vec::with_capacity(512);
    let complete = tokio::time::timeout(READ_TIMEOUT, async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            if head.len() > MAX_HEAD {
                return false;
            }
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        true
    })
    .await
    .unwrap_or(false);
    if !complete {
        return Ok(());
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") => match rendered(render, cache).await {
            Some(text) => ("200 OK", text),
            None => (
                "500 Internal Server Error",
                Arc::new("rendering failed\n".into()),
            ),
        },
        ("GET" | "HEAD", _) => (
            "404 Not Found",
            Arc::new("only /metrics is served here\n".into()),
        ),
        _ => (
            "405 Method Not Allowed",
            Arc::new("only GET /metrics\n".into()),
        ),
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if method != "HEAD" {
        out.push_str(&body);
    }
    tokio::time::timeout(READ_TIMEOUT, conn.write_all(out.as_bytes()))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    conn.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format() {
        let mut e = Exposition::new();
        e.metric("quiltfs.fs-ops", Kind::Counter, "Operations.", 12.0);
        e.family(
            "role",
            Kind::Gauge,
            "Role.",
            &[
                (&[("replica", "0"), ("name", "a\"b")], 1.0),
                (&[("replica", "1")], 0.5),
            ],
        );
        assert_eq!(
            e.finish(),
            "# HELP quiltfs_fs_ops Operations.\n# TYPE quiltfs_fs_ops counter\nquiltfs_fs_ops 12\n\
             # HELP role Role.\n# TYPE role gauge\nrole{replica=\"0\",name=\"a\\\"b\"} 1\nrole{replica=\"1\"} 0.5\n"
        );
        assert_eq!(metric_name("9x"), "_9x");
    }

    async fn get(addr: std::net::SocketAddr, request: &[u8]) -> String {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(request).await.unwrap();
        let mut out = String::new();
        // A dropped connection with bytes unread ends in a reset: no answer either.
        match c.read_to_string(&mut out).await {
            Ok(_) => out,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => String::new(),
            Err(e) => panic!("{e}"),
        }
    }

    #[tokio::test]
    async fn serves_metrics_and_refuses_the_rest() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(l, || "up 1\n".to_string(), async move {
            let _ = rx.await;
        }));
        let ok = get(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\nup 1\n"), "{ok}");
        assert!(get(addr, b"GET / HTTP/1.1\r\n\r\n")
            .await
            .starts_with("HTTP/1.1 404"));
        assert!(get(addr, b"POST /metrics HTTP/1.1\r\n\r\n")
            .await
            .starts_with("HTTP/1.1 405"));
        // A head that never ends, past the bound: dropped without an answer.
        let junk = vec![b'x'; MAX_HEAD + 2048];
        assert_eq!(get(addr, &junk).await, "");
        // The server still answers after all that.
        assert!(get(addr, b"GET /metrics HTTP/1.0\r\n\r\n")
            .await
            .contains("up 1"));
        tx.send(()).unwrap();
        server.await.unwrap();
    }

    /// Scrapes within a second share one render; idle connections beyond the bound
    /// wait, and the server answers again once they are gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn renders_are_shared_and_connections_bounded() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let renders = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let r = renders.clone();
        let render = move || {
            let n = r.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            format!("renders {n}\n")
        };
        let server = tokio::spawn(serve(l, render, std::future::pending()));
        for _ in 0..20 {
            assert!(get(addr, b"GET /metrics HTTP/1.1\r\n\r\n")
                .await
                .ends_with("renders 1\n"));
        }
        assert_eq!(renders.load(std::sync::atomic::Ordering::SeqCst), 1);
        // Idle connections hold every slot: a scrape waits for the head timeout.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t = std::time::Instant::now();
        let text = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n").await;
        assert!(text.contains("renders"), "{text}");
        assert!(
            t.elapsed() >= Duration::from_secs(3),
            "answered past the bound"
        );
        drop(idle);
        server.abort();
    }
}
