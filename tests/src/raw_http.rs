//! HTTP/1.1 spoken by hand on a socket, for what a client library would not
//! send (a malformed head) or would not keep (an idle keep-alive connection).

use anyhow::{Context, ensure};
use tokio::io::{AsyncRead, AsyncReadExt};

/// How long a raw-socket test waits for an answer.
pub const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads one HTTP/1.1 response with a `Content-Length` body: its status and body.
pub async fn read_response(stream: &mut (impl AsyncRead + Unpin)) -> anyhow::Result<(u16, Vec<u8>)> {
    let mut data = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(end) = data.windows(4).position(|window| window == b"\r\n\r\n") {
            break end + 4;
        }
        let read = tokio::time::timeout(ANSWER_TIMEOUT, stream.read(&mut chunk))
            .await
            .context("no answer")??;
        ensure!(read > 0, "closed without an answer: {}", String::from_utf8_lossy(&data));
        data.extend_from_slice(&chunk[..read]);
    };
    let head = String::from_utf8_lossy(&data[..head_end]).to_ascii_lowercase();
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status in {}", head))?;
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0);
    let mut body = data.split_off(head_end);
    while body.len() < length {
        let read = tokio::time::timeout(ANSWER_TIMEOUT, stream.read(&mut chunk))
            .await
            .context("the body did not come")??;
        ensure!(read > 0, "closed within the body");
        body.extend_from_slice(&chunk[..read]);
    }
    body.truncate(length);
    Ok((status, body))
}
