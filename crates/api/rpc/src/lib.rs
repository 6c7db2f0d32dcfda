//! What quiltfs's servers (Gnothi's replicas, the Cudele metadata service) share on the
//! wire: gRPC through tonic whose messages are the crates' own serde types in postcard
//! ([`PostcardCodec`]; each service is described in its crate's `build.rs`, so no
//! protoc is needed), a shared secret in every request's metadata checked before the
//! message is decoded ([`SecretCheck`]), and TLS certificates for trying a cluster on
//! one machine ([`make_certificates`]); and a Prometheus endpoint for their counters
//! ([`metrics`]).

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod metrics;

use bytes::{Buf, BufMut};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::marker::PhantomData;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::Status;

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
        // Straight into the frame's buffer: a megabyte of block data is not copied
        // through a Vec first.
        postcard::to_io(&item, buf.writer())
            .map(|_| ())
            .map_err(|e| Status::internal(format!("encoding: {e}")))
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

/// A cluster's shared secret as request metadata under `key`.
pub fn secret_value(secret: &str) -> Result<MetadataValue<Ascii>, String> {
    secret
        .parse()
        .map_err(|_| "the cluster secret must be printable ASCII".to_string())
}

/// The server side of the shared secret: an interceptor that refuses a request whose
/// metadata `key` does not hold it, before its message is decoded.
#[derive(Clone)]
pub struct SecretCheck {
    key: &'static str,
    want: MetadataValue<Ascii>,
}

impl SecretCheck {
    pub fn new(key: &'static str, secret: &str) -> Result<SecretCheck, String> {
        Ok(SecretCheck {
            key,
            want: secret_value(secret)?,
        })
    }
}

impl tonic::service::Interceptor for SecretCheck {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        match req.metadata().get(self.key) {
            Some(got) if got == self.want => Ok(req),
            _ => Err(Status::unauthenticated("wrong or missing cluster secret")),
        }
    }
}

/// A tonic server, over TLS with `tls` (`who` names the server in the error).
pub fn server_builder(
    tls: Option<TlsIdentity>,
    who: &str,
) -> Result<tonic::transport::Server, String> {
    use tonic::transport::{Identity, ServerTlsConfig};
    let builder = tonic::transport::Server::builder();
    match tls {
        None => Ok(builder),
        Some(t) => builder
            .tls_config(ServerTlsConfig::new().identity(Identity::from_pem(t.cert_pem, t.key_pem)))
            .map_err(|e| format!("{who}'s TLS certificate or key: {e}")),
    }
}

/// A server's TLS identity: its certificate (PEM, signed by the cluster's CA, naming
/// the host its address uses) and private key.
#[derive(Clone)]
pub struct TlsIdentity {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

/// A cluster's certificates, for trying TLS on one machine and for the tests: a CA,
/// and for each host name or address in `hosts` a certificate and key signed by it.
/// Production clusters bring their own (any CA; each server's certificate must name
/// the host its address uses).
pub fn make_certificates(hosts: &[Vec<String>]) -> Result<(Vec<u8>, Vec<TlsIdentity>), String> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let err = |e: rcgen::Error| format!("making certificates: {e}");
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "quiltfs cluster CA");
    let ca_key = KeyPair::generate().map_err(err)?;
    let ca_cert = ca.self_signed(&ca_key).map_err(err)?;
    let mut out = Vec::new();
    for names in hosts {
        let mut p = CertificateParams::new(names.clone()).map_err(err)?;
        p.distinguished_name.push(
            DnType::CommonName,
            names.first().cloned().unwrap_or_default(),
        );
        let key = KeyPair::generate().map_err(err)?;
        let cert = p.signed_by(&key, &ca_cert, &ca_key).map_err(err)?;
        out.push(TlsIdentity {
            cert_pem: cert.pem().into_bytes(),
            key_pem: key.serialize_pem().into_bytes(),
        });
    }
    Ok((ca_cert.pem().into_bytes(), out))
}
