//! Replicas over real gRPC on loopback: a volume of three servers in this process,
//! written and read through `GrpcNet`; a client with the wrong secret is refused
//! before anything is decoded; garbage on a server's port, and a frame past the size
//! limit, get errors and the servers serve on. Over TLS: a client trusting the
//! cluster's CA reads and writes; one without TLS, or trusting another CA, gets in
//! nowhere.

use quilt_block::{BlockDevice, MemDevice};
use quilt_gnothi::client::{Client, ClientConfig, ClientError};
use quilt_gnothi::node::{Node, NodeConfig};
use quilt_gnothi::replica::Local;
use quilt_gnothi::rpc::{Request, Response};
use quilt_gnothi::server::{label_for, LogSizes};
use quilt_gnothi::store::DataStore;
use quilt_gnothi::transport::{make_certificates, serve, GrpcNet, TlsIdentity};
use quilt_gnothi::{Geometry, System};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const SECRET: &str = "a-test-secret-of-enough-length";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn cluster() -> (BTreeMap<u64, String>, Vec<tokio::sync::oneshot::Sender<()>>) {
    cluster_with(None).await
}

/// With `tls`: the CA, and each replica's identity.
async fn cluster_with(
    tls: Option<(Vec<u8>, Vec<TlsIdentity>)>,
) -> (BTreeMap<u64, String>, Vec<tokio::sync::oneshot::Sender<()>>) {
    let g = Geometry::new(System::Gnothi, 1, 4096, 1024, 64).unwrap();
    let peers: BTreeMap<u64, String> = (0..3u64)
        .map(|r| (r, format!("127.0.0.1:{}", free_port())))
        .collect();
    let members = peers
        .iter()
        .map(|(&r, a)| (r, openraft::BasicNode::new(a.clone())))
        .collect::<BTreeMap<_, _>>();
    let sizes = LogSizes {
        raft: 8 << 20,
        data: 8 << 20,
    };
    let mut stops = Vec::new();
    for r in 0..3u16 {
        let label = label_for(r, "t", g, 256, sizes);
        let log: Arc<dyn BlockDevice> =
            Arc::new(MemDevice::new(4096, label.blocks_needed()).unwrap());
        let data: Arc<dyn BlockDevice> =
            Arc::new(MemDevice::new(4096, DataStore::blocks_needed(&g, r, 256)).unwrap());
        Local::format(&log, &label).unwrap();
        let ca = tls.as_ref().map(|(ca, _)| ca.clone());
        let identity = tls.as_ref().map(|(_, ids)| ids[r as usize].clone());
        let net = GrpcNet::with_tls(peers.clone(), SECRET, ca).unwrap();
        let node = Node::start(r, log, data, net, members.clone(), NodeConfig::default())
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let listen = peers[&u64::from(r)].parse().unwrap();
        tokio::spawn(async move {
            let _ = serve(node, listen, SECRET.into(), identity, async {
                let _ = rx.await;
            })
            .await;
        });
        stops.push(tx);
    }
    (peers, stops)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_over_grpc_serves_and_refuses_bad_input() {
    let (peers, _stops) = cluster().await;
    let net = GrpcNet::new(peers.clone(), SECRET).unwrap();
    let client = Client::connect(net.clone(), 3, 1, ClientConfig::default())
        .await
        .unwrap();
    let data: Vec<u8> = (0..8 * 4096).map(|i| (i % 253) as u8).collect();
    client.write(60, &data).await.unwrap();
    assert_eq!(client.read(60, 8).await.unwrap(), data);

    // The wrong secret: refused, whatever the request.
    let wrong = GrpcNet::new(peers.clone(), "not-the-secret-at-all").unwrap();
    let cfg = ClientConfig {
        op_timeout: Duration::from_secs(1),
        ..ClientConfig::default()
    };
    match Client::connect(wrong, 3, 2, cfg).await {
        Err(ClientError::NoReplica(why)) => assert!(why.contains("secret"), "{why}"),
        other => panic!(
            "a client with the wrong secret got in: {:?}",
            other.map(|_| ())
        ),
    }

    // Server 0's address taken for another server's (as after a replacement at the
    // same address): data and agreement messages meant for that one are refused, with
    // the reason; a status question is answered, and says who is there.
    let mut misdirected = peers.clone();
    misdirected.insert(7, peers[&0].clone());
    let mis = GrpcNet::new(misdirected, SECRET).unwrap();
    let put = Request::PutData {
        write: quilt_gnothi::WriteId { client: 9, seq: 1 },
        first: 0,
        data: vec![0u8; 4096],
    };
    match quilt_gnothi::net::call_within(mis.as_ref(), 7, put, Duration::from_secs(5)).await {
        Err(e) => assert!(e.to_string().contains("agreement id 0, not 7"), "{e}"),
        Ok(other) => panic!("data meant for server 7 was taken by server 0: {other:?}"),
    }
    let fetch = Request::Fetch { first: 0, count: 1 };
    assert!(
        quilt_gnothi::net::call_within(mis.as_ref(), 7, fetch, Duration::from_secs(5))
            .await
            .is_err()
    );
    match quilt_gnothi::net::call_within(mis.as_ref(), 7, Request::Status, Duration::from_secs(5))
        .await
    {
        Ok(Response::Status(st)) => assert_eq!(st.node, 0),
        other => panic!("a status question was not answered: {other:?}"),
    }

    // Garbage on the port: the connection fails, the server does not.
    for addr in peers.values() {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let _ = s.write_all(b"\x00\x00\x00\x00\x05hello, this is not http/2 at all\r\n\r\n");
        let _ = s.write_all(&[0xff; 4096]);
    }
    // A message past the size limit: an error, not a crash.
    let big = Request::PutData {
        write: quilt_gnothi::WriteId { client: 9, seq: 0 },
        first: 0,
        data: vec![0u8; 4 << 20],
    };
    assert!(
        quilt_gnothi::net::call_within(net.as_ref(), 0, big, Duration::from_secs(5))
            .await
            .is_err()
    );
    // A request for blocks outside the volume: a clear error.
    match quilt_gnothi::net::call_within(
        net.as_ref(),
        1,
        Request::Read {
            first: 1020,
            count: 10,
        },
        Duration::from_secs(5),
    )
    .await
    {
        Ok(Response::Error(e)) => assert!(e.to_string().contains("outside the volume"), "{e}"),
        other => panic!("an out-of-range read got {other:?}"),
    }
    // Still serving.
    let more: Vec<u8> = vec![7u8; 4096];
    client.write(3, &more).await.unwrap();
    assert_eq!(client.read(3, 1).await.unwrap(), more);
    assert_eq!(client.read(60, 8).await.unwrap(), data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_only_clients_that_trust_the_cluster_ca_get_in() {
    let hosts: Vec<Vec<String>> = (0..3).map(|_| vec!["127.0.0.1".to_string()]).collect();
    let (ca, ids) = make_certificates(&hosts).unwrap();
    let (peers, _stops) = cluster_with(Some((ca.clone(), ids))).await;
    let net = GrpcNet::with_tls(peers.clone(), SECRET, Some(ca)).unwrap();
    let client = Client::connect(net, 3, 1, ClientConfig::default())
        .await
        .unwrap();
    let data: Vec<u8> = (0..4 * 4096).map(|i| (i % 251) as u8).collect();
    client.write(8, &data).await.unwrap();
    assert_eq!(client.read(8, 4).await.unwrap(), data);

    let cfg = ClientConfig {
        op_timeout: Duration::from_secs(1),
        ..ClientConfig::default()
    };
    // Plain HTTP/2 to a TLS server: nothing answers.
    let plain = GrpcNet::new(peers.clone(), SECRET).unwrap();
    assert!(Client::connect(plain, 3, 2, cfg.clone()).await.is_err());
    // TLS trusting another CA: the replicas' certificates are refused.
    let (other_ca, _) = make_certificates(&[]).unwrap();
    let stranger = GrpcNet::with_tls(peers.clone(), SECRET, Some(other_ca)).unwrap();
    assert!(Client::connect(stranger, 3, 3, cfg).await.is_err());
    // The trusted client still works.
    assert_eq!(client.read(8, 4).await.unwrap(), data);
}
