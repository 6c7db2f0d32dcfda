//! gRPC between processes (tonic): the replica server, and [`GrpcNet`], the [`Net`]
//! that reaches replicas by address. One unary method carries the crate's own messages
//! (`rpc.rs`) in postcard; the service is described in `build.rs`.
//!
//! Every request carries the cluster's shared secret in its metadata; the server checks
//! it before the message is decoded, and refuses frames larger than a block batch.

use crate::net::{BoxFuture, Net, NetError};
use crate::node::Node;
use crate::rpc::{Request, Response, MAX_DATA};
use bytes::{Buf, BufMut};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

#[allow(clippy::all, clippy::unwrap_used)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/gnothi.Replica.rs"));
}
use generated::replica_client::ReplicaClient;
use generated::replica_server::{Replica, ReplicaServer};

/// The largest message on the wire: a batch of blocks and its envelope.
pub const MAX_MESSAGE: usize = MAX_DATA + (64 << 10);
const SECRET_KEY: &str = "x-gnothi-secret";

/// Postcard in, postcard out.
pub struct PostcardCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for PostcardCodec<T, U> {
    fn default() -> Self {
        PostcardCodec(PhantomData)
    }
}

pub struct PostcardEncoder<T>(PhantomData<T>);
pub struct PostcardDecoder<U>(PhantomData<U>);

impl<T, U> Codec for PostcardCodec<T, U>
where
    T: Serialize + Send + 'static,
    U: DeserializeOwned + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = PostcardEncoder<T>;
    type Decoder = PostcardDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        PostcardEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        PostcardDecoder(PhantomData)
    }
}

impl<T: Serialize> Encoder for PostcardEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        let bytes =
            postcard::to_stdvec(&item).map_err(|e| Status::internal(format!("encoding: {e}")))?;
        buf.put_slice(&bytes);
        Ok(())
    }
}

impl<U: DeserializeOwned> Decoder for PostcardDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let bytes = buf.copy_to_bytes(buf.remaining());
        postcard::from_bytes(&bytes)
            .map(Some)
            .map_err(|e| Status::invalid_argument(format!("a message that does not decode: {e}")))
    }
}

struct Service {
    node: Arc<Node>,
}

#[tonic::async_trait]
impl Replica for Service {
    async fn call(
        &self,
        request: tonic::Request<Request>,
    ) -> Result<tonic::Response<Response>, Status> {
        Ok(tonic::Response::new(
            self.node.handle(request.into_inner()).await,
        ))
    }
}

fn secret_value(secret: &str) -> Result<MetadataValue<tonic::metadata::Ascii>, String> {
    secret
        .parse()
        .map_err(|_| "the cluster secret must be printable ASCII".to_string())
}

/// Serves `node` on `listen` until `shutdown` resolves.
pub async fn serve(
    node: Arc<Node>,
    listen: SocketAddr,
    secret: String,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), String> {
    let want = secret_value(&secret)?;
    let check = move |req: tonic::Request<()>| -> Result<tonic::Request<()>, Status> {
        match req.metadata().get(SECRET_KEY) {
            Some(got) if got == want => Ok(req),
            _ => Err(Status::unauthenticated("wrong or missing cluster secret")),
        }
    };
    let svc = ReplicaServer::new(Service { node })
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    tonic::transport::Server::builder()
        .add_service(tonic::service::interceptor::InterceptedService::new(
            svc, check,
        ))
        .serve_with_shutdown(listen, shutdown)
        .await
        .map_err(|e| format!("serving on {listen}: {e}"))
}

/// Replicas by id, reached over gRPC; connections are made on first use and kept.
pub struct GrpcNet {
    peers: BTreeMap<u64, String>,
    secret: MetadataValue<tonic::metadata::Ascii>,
    channels: Mutex<BTreeMap<u64, Channel>>,
    connect_timeout: Duration,
}

impl GrpcNet {
    /// `peers`: replica id → `host:port`.
    pub fn new(peers: BTreeMap<u64, String>, secret: &str) -> Result<Arc<GrpcNet>, String> {
        Ok(Arc::new(GrpcNet {
            peers,
            secret: secret_value(secret)?,
            channels: Mutex::new(BTreeMap::new()),
            connect_timeout: Duration::from_secs(2),
        }))
    }

    fn channel(&self, to: u64) -> Result<Channel, NetError> {
        let mut chans = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = chans.get(&to) {
            return Ok(c.clone());
        }
        let addr = self.peers.get(&to).ok_or(NetError::NoSuchReplica(to))?;
        let ep = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| NetError::Unreachable(to, format!("address {addr}: {e}")))?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true);
        let c = ep.connect_lazy();
        chans.insert(to, c.clone());
        Ok(c)
    }
}

impl Net for GrpcNet {
    fn call(&self, to: u64, req: Request) -> BoxFuture<'_, Result<Response, NetError>> {
        Box::pin(async move {
            let ch = self.channel(to)?;
            let mut client = ReplicaClient::new(ch)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE);
            let mut r = tonic::Request::new(req);
            r.metadata_mut().insert(SECRET_KEY, self.secret.clone());
            match client.call(r).await {
                Ok(resp) => Ok(resp.into_inner()),
                Err(s) => Err(NetError::Unreachable(to, s.message().to_string())),
            }
        })
    }
}
