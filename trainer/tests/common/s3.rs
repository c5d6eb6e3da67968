//! s3s-fs, a real S3-compatible server over HTTP, in this process.

use std::net::SocketAddr;

/// The access key and secret the server takes.
pub const ACCESS_KEY: &str = "AKIDTAPLINE";
/// See [`ACCESS_KEY`].
pub const SECRET_KEY: &str = "tapline-secret";

/// Serves the directory `root` as S3 on a loopback port, with a bucket `records`; runs
/// until the runtime ends.
pub async fn s3s_server(root: &std::path::Path) -> SocketAddr {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    std::fs::create_dir_all(root.join("records")).expect("bucket dir");
    let fs = s3s_fs::FileSystem::new(root).expect("s3s-fs");
    let mut builder = s3s::service::S3ServiceBuilder::new(fs);
    builder.set_auth(s3s::auth::SimpleAuth::from_single(ACCESS_KEY, SECRET_KEY));
    let service = builder.build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            // Without it a response written in two parts waits for a delayed ACK (~40 ms).
            let _ = socket.set_nodelay(true);
            let service = service.clone();
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    addr
}

/// The store URL of `prefix` in the bucket `records` of the server at `addr`.
pub fn url(addr: SocketAddr, prefix: &str) -> String {
    format!(
        "s3://records/{prefix}?endpoint=http://{addr}&region=us-east-1&access_key_id={ACCESS_KEY}&secret_access_key={SECRET_KEY}"
    )
}
