//! A foreign publisher: Python's pika, in a virtualenv under `target/`
//! (created on first use), for messages lapin cannot even express (short
//! strings that are not UTF-8).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// A message as bytes on the wire: every field is taken as is.
#[derive(Debug, Default, Clone)]
pub struct RawMessage {
    pub body: Vec<u8>,
    pub message_id: Option<Vec<u8>>,
    pub content_type: Option<Vec<u8>>,
    /// Header names (bytes) with string values.
    pub headers: Vec<(Vec<u8>, String)>,
}

/// The virtualenv's python, with pika installed.
pub fn python() -> PathBuf {
    static READY: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
    let mut ready = READY.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(python) = &*ready {
        return python.clone();
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/pika-venv");
    let python = venv.join("bin/python");
    let has_pika = |python: &PathBuf| {
        Command::new(python)
            .args(["-c", "import pika"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if !has_pika(&python) {
        let made = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 is needed for the foreign-publisher tests");
        assert!(made.success(), "python3 -m venv {venv:?} failed");
        let installed = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "pika==1.3.2"])
            .status()
            .expect("run pip");
        assert!(
            installed.success(),
            "pip install pika failed (the foreign-publisher tests need PyPI, or a \
             virtualenv with pika at {venv:?})"
        );
    }
    *ready = Some(python.clone());
    python
}

const SCRIPT: &str = r#"
import json, sys, pika
spec = json.load(sys.stdin)
connection = pika.BlockingConnection(pika.URLParameters(spec["url"]))
channel = connection.channel()
channel.confirm_delivery()
h = bytes.fromhex
for m in spec["messages"]:
    properties = pika.BasicProperties(
        delivery_mode=2,
        message_id=h(m["message_id"]) if m["message_id"] is not None else None,
        content_type=h(m["content_type"]) if m["content_type"] is not None else None,
        headers={h(k): v for k, v in m["headers"]} or None,
    )
    channel.basic_publish("", spec["queue"], h(m["body"]), properties, mandatory=True)
connection.close()
"#;

/// Publishes `messages` to `queue` through the default exchange, with
/// publisher confirms, from pika.
pub fn publish(queue: &str, messages: &[RawMessage]) {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let spec = serde_json::json!({
        "url": super::amqp_url(),
        "queue": queue,
        "messages": messages.iter().map(|m| serde_json::json!({
            "body": hex(&m.body),
            "message_id": m.message_id.as_deref().map(hex),
            "content_type": m.content_type.as_deref().map(hex),
            "headers": m.headers.iter().map(|(k, v)| (hex(k), v.clone())).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    });
    let mut child = Command::new(python())
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .spawn()
        .expect("run python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(spec.to_string().as_bytes())
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "pika could not publish");
}
