//! gRPC (tonic) for the metadata service: the server around [`Mds`], and a channel to
//! it. Every request carries the shared secret in its metadata, checked before the
//! message is decoded; with TLS the service presents its certificate and clients
//! verify it against the cluster's CA.

use crate::rpc::{Request, Response, MAX_MESSAGE};
use crate::service::Mds;
use quilt_rpc::{secret_value, SecretCheck, TlsIdentity};
use std::sync::Arc;
use std::time::Duration;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::Status;

#[allow(clippy::all, clippy::unwrap_used)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/cudele.Mds.rs"));
}
use generated::mds_client::MdsClient;
use generated::mds_server::{Mds as MdsService, MdsServer};

pub const SECRET_KEY: &str = "x-quiltfs-secret";
/// The client's token (hex), given at hello.
pub const TOKEN_KEY: &str = "x-quiltfs-client";

struct Service {
    mds: Arc<Mds>,
}

#[tonic::async_trait]
impl MdsService for Service {
    async fn call(
        &self,
        request: tonic::Request<Request>,
    ) -> Result<tonic::Response<Response>, Status> {
        let mds = self.mds.clone();
        let token = request
            .metadata()
            .get(TOKEN_KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(|t| u128::from_str_radix(t, 16).ok());
        let req = request.into_inner();
        // The store's calls block. On a multi-threaded runtime the request runs where
        // it is, its worker's other tasks moved away meanwhile (`block_in_place`): a
        // lookup or getattr then costs no hand-off to another thread and back, which
        // on this machine is most of a request's time. Else off the workers.
        let multi = tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread;
        if multi {
            return Ok(tonic::Response::new(tokio::task::block_in_place(|| {
                mds.handle(token, req)
            })));
        }
        match tokio::task::spawn_blocking(move || mds.handle(token, req)).await {
            Ok(r) => Ok(tonic::Response::new(r)),
            Err(e) => Err(Status::internal(format!("the request's task failed: {e}"))),
        }
    }
}

/// Serves `mds` on `listener` (bound by the caller, so that port 0 works and the
/// address is known) until `shutdown` resolves; over TLS with `tls`.
pub async fn serve(
    mds: Arc<Mds>,
    listener: tokio::net::TcpListener,
    secret: &str,
    tls: Option<TlsIdentity>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), String> {
    let check = SecretCheck::new(SECRET_KEY, secret)?;
    let at = listener
        .local_addr()
        .map_or_else(|_| "its port".to_string(), |a| a.to_string());
    let svc = MdsServer::new(Service { mds })
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let mut builder = quilt_rpc::server_builder(tls, "the service")?;
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let (began, grace) = tokio::sync::oneshot::channel::<()>();
    let server = builder
        .add_service(tonic::service::interceptor::InterceptedService::new(
            svc, check,
        ))
        .serve_with_incoming_shutdown(incoming, async move {
            shutdown.await;
            let _ = began.send(());
        });
    // A graceful shutdown waits for every connection to close, and a client that
    // never reads its connection again (hung, stopped, or one whose thread is gone)
    // never lets it: a bounded wait, then they are dropped.
    tokio::select! {
        r = server => r.map_err(|e| format!("serving on {at}: {e}")),
        () = async {
            if grace.await.is_err() {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {
            tracing::warn!(
                "mds: connections still open {} s after the shutdown began: closed",
                SHUTDOWN_GRACE.as_secs()
            );
            Ok(())
        }
    }
}

/// How long a shutdown waits for clients to close their connections.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A channel to the service.
#[derive(Clone)]
pub struct Channelled {
    channel: Channel,
    secret: MetadataValue<Ascii>,
    addr: String,
}

impl Channelled {
    /// A lazy channel to `addr` (`host:port`); with `ca_pem`, over TLS.
    pub fn new(addr: &str, secret: &str, ca_pem: Option<Vec<u8>>) -> Result<Channelled, String> {
        let scheme = if ca_pem.is_some() { "https" } else { "http" };
        let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| format!("address {addr}: {e}"))?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true);
        if let Some(ca) = ca_pem {
            ep = ep
                .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)))
                .map_err(|e| format!("TLS for {addr}: {e}"))?;
        }
        Ok(Channelled {
            channel: ep.connect_lazy(),
            secret: secret_value(secret)?,
            addr: addr.to_string(),
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// One request as the client of `token` (none for a hello); a transport failure or
    /// a refusal (a wrong secret) is the error.
    pub async fn call(&self, token: Option<u128>, req: Request) -> Result<Response, Status> {
        let mut c = MdsClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let mut r = tonic::Request::new(req);
        r.metadata_mut().insert(SECRET_KEY, self.secret.clone());
        if let Some(t) = token {
            if let Ok(v) = format!("{t:032x}").parse() {
                r.metadata_mut().insert(TOKEN_KEY, v);
            }
        }
        c.call(r).await.map(|r| r.into_inner())
    }
}
