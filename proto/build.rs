//! Compiles `proto/kvasir/v1/*.proto` with protox (pure Rust, no `protoc`)
//! and generates prost messages always, tonic server / client code only
//! with the `server` / `client` features (so the messages build for wasm32).
//! With `ext-proc`, also Envoy's external processing service from the
//! vendored `third_party/` protos (the endpoint-picker protocol).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = std::env::var_os("CARGO_FEATURE_SERVER").is_some();
    let client = std::env::var_os("CARGO_FEATURE_CLIENT").is_some();
    let files = ["proto/kvasir/v1/indexer.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(server)
        .build_client(client)
        // The client's `connect` needs tonic's transport; callers build a
        // Channel themselves instead, so `client` stays light.
        .build_transport(false)
        .compile_fds(fds)?;
    if std::env::var_os("CARGO_FEATURE_EXT_PROC").is_some() {
        println!("cargo:rerun-if-changed=third_party");
        let includes = [
            "third_party/data-plane-api",
            "third_party/xds",
            "third_party/protoc-gen-validate",
        ];
        let fds = protox::compile(
            ["envoy/service/ext_proc/v3/external_processor.proto"],
            includes,
        )?;
        tonic_prost_build::configure()
            .build_server(server)
            .build_client(client)
            .build_transport(false)
            .compile_well_known_types(false)
            .compile_fds(fds)?;
    }
    Ok(())
}
