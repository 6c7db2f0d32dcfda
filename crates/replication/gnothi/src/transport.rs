//! gRPC between processes (tonic): the replica server, and [`GrpcNet`], the [`Net`]
//! that reaches replicas by address. One unary method carries the crate's own messages
//! (`rpc.rs`) in postcard; the service is described in `build.rs`.
//!
//! Every request carries the cluster's shared secret in its metadata; the server checks
//! it before the message is decoded, and refuses frames larger than a block batch.
//! With TLS (rustls), a replica presents its certificate and every caller verifies it
//! against the cluster's CA: the secret then travels encrypted, to a replica that
//! proved who it is.

use crate::net::{BoxFuture, Net, NetError};
use crate::node::Node;
use crate::rpc::{Request, Response};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::Status;

pub use quilt_rpc::{make_certificates, PostcardCodec, TlsIdentity};
use quilt_rpc::{secret_value, SecretCheck};

#[allow(clippy::all, clippy::unwrap_used)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/gnothi.Replica.rs"));
}
use generated::replica_client::ReplicaClient;
use generated::replica_server::{Replica, ReplicaServer};

pub use crate::rpc::MAX_MESSAGE;
const SECRET_KEY: &str = "x-gnothi-secret";
/// The agreement id of the server a request is meant for. A server replaced by another
/// at the same address must not have its messages answered by the new one: during the
/// joint change, agreement would count one server's answers for both ids.
const TO_KEY: &str = "x-gnothi-to";

struct Service {
    node: Arc<Node>,
}

#[tonic::async_trait]
impl Replica for Service {
    async fn call(
        &self,
        request: tonic::Request<Request>,
    ) -> Result<tonic::Response<Response>, Status> {
        let to = request
            .metadata()
            .get(TO_KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let req = request.into_inner();
        if let Some(to) = to.filter(|&to| to != self.node.node_id && for_one_server(&req)) {
            return Err(Status::failed_precondition(format!(
                "this server is agreement id {}, not {to} (a server that replaced it at \
                 this address?)",
                self.node.node_id
            )));
        }
        Ok(tonic::Response::new(self.node.handle(req).await))
    }
}

/// Whether only the server a request names may answer it: agreement's messages and
/// data stored or fetched as a slot's copy. Questions any server may answer truthfully
/// (status, reads, proposals, which a follower redirects) are let through, so a
/// caller that knows an address but not who serves it now can learn it.
fn for_one_server(req: &Request) -> bool {
    matches!(
        req,
        Request::AppendEntries(_)
            | Request::Vote(_)
            | Request::InstallSnapshot(_)
            | Request::PutData { .. }
            | Request::Fetch { .. }
    )
}

/// Serves `node` on `listen` until `shutdown` resolves; over TLS with `tls`.
pub async fn serve(
    node: Arc<Node>,
    listen: SocketAddr,
    secret: String,
    tls: Option<TlsIdentity>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), String> {
    let check = SecretCheck::new(SECRET_KEY, &secret)?;
    let svc = ReplicaServer::new(Service { node })
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let mut builder = quilt_rpc::server_builder(tls, "the replica")?;
    builder
        .add_service(tonic::service::interceptor::InterceptedService::new(
            svc, check,
        ))
        .serve_with_shutdown(listen, shutdown)
        .await
        .map_err(|e| format!("serving on {listen}: {e}"))
}

/// Replicas by id, reached over gRPC; connections are made on first use and kept.
pub struct GrpcNet {
    /// Replica id → `host:port`: those configured, and those learned since (servers
    /// that replaced others: `Net::learn`).
    peers: Mutex<BTreeMap<u64, String>>,
    secret: MetadataValue<tonic::metadata::Ascii>,
    /// With TLS: the cluster's CA, which every replica's certificate must chain to.
    tls: Option<ClientTlsConfig>,
    channels: Mutex<BTreeMap<u64, Channel>>,
    connect_timeout: Duration,
}

impl GrpcNet {
    /// `peers`: replica id → `host:port`.
    pub fn new(peers: BTreeMap<u64, String>, secret: &str) -> Result<Arc<GrpcNet>, String> {
        GrpcNet::with_tls(peers, secret, None)
    }

    /// As [`GrpcNet::new`]; with `ca_pem`, replicas are reached over TLS and their
    /// certificates verified against it (a replica that cannot prove its name is not
    /// called, and the secret is never sent in the clear).
    pub fn with_tls(
        peers: BTreeMap<u64, String>,
        secret: &str,
        ca_pem: Option<Vec<u8>>,
    ) -> Result<Arc<GrpcNet>, String> {
        let tls = ca_pem.map(|ca| ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)));
        Ok(Arc::new(GrpcNet {
            peers: Mutex::new(peers),
            secret: secret_value(secret)?,
            tls,
            channels: Mutex::new(BTreeMap::new()),
            connect_timeout: Duration::from_secs(2),
        }))
    }

    fn channel(&self, to: u64) -> Result<Channel, NetError> {
        let mut chans = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = chans.get(&to) {
            return Ok(c.clone());
        }
        let addr = self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&to)
            .cloned()
            .ok_or(NetError::NoSuchReplica(to))?;
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| NetError::Unreachable(to, format!("address {addr}: {e}")))?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true);
        if let Some(tls) = &self.tls {
            ep = ep
                .tls_config(tls.clone())
                .map_err(|e| NetError::Unreachable(to, format!("TLS for {addr}: {e}")))?;
        }
        let c = ep.connect_lazy();
        chans.insert(to, c.clone());
        Ok(c)
    }
}

impl Net for GrpcNet {
    fn learn(&self, id: u64, addr: &str) {
        // (Channels before peers, as `channel` takes them.)
        let mut chans = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if peers.get(&id).map(String::as_str) != Some(addr) {
            peers.insert(id, addr.to_string());
            // A channel to where it was before goes.
            chans.remove(&id);
        }
    }

    fn call(&self, to: u64, req: Request) -> BoxFuture<'_, Result<Response, NetError>> {
        Box::pin(async move {
            let ch = self.channel(to)?;
            let mut client = ReplicaClient::new(ch)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE);
            let mut r = tonic::Request::new(req);
            r.metadata_mut().insert(SECRET_KEY, self.secret.clone());
            r.metadata_mut().insert(TO_KEY, MetadataValue::from(to));
            match client.call(r).await {
                Ok(resp) => Ok(resp.into_inner()),
                Err(s) => Err(NetError::Unreachable(to, s.message().to_string())),
            }
        })
    }
}
