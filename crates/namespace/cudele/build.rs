//! The metadata service's gRPC service, described here instead of in a .proto file:
//! one unary method whose messages are the crate's own serde types (`rpc.rs`), carried
//! by quilt-rpc's postcard codec. No protoc is needed to build.

fn main() {
    let call = tonic_build::manual::Method::builder()
        .name("call")
        .route_name("Call")
        .input_type("crate::rpc::Request")
        .output_type("crate::rpc::Response")
        .codec_path("quilt_rpc::PostcardCodec")
        .build();
    let service = tonic_build::manual::Service::builder()
        .name("Mds")
        .package("cudele")
        .method(call)
        .build();
    tonic_build::manual::Builder::new().compile(&[service]);
}
