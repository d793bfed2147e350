//! Compiles `proto/kvasir/v1/*.proto` with protox (pure Rust, no `protoc`)
//! and generates prost messages always, tonic server / client code only
//! with the `server` / `client` features (so the messages build for wasm32).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/kvasir/v1/indexer.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    let server = std::env::var_os("CARGO_FEATURE_SERVER").is_some();
    let client = std::env::var_os("CARGO_FEATURE_CLIENT").is_some();
    tonic_prost_build::configure()
        .build_server(server)
        .build_client(client)
        // The client's `connect` needs tonic's transport; callers build a
        // Channel themselves instead, so `client` stays light.
        .build_transport(false)
        .compile_fds(fds)?;
    Ok(())
}
