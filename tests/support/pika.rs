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

/// Describes AMQP values as pika decodes them, with their types.
const DESCRIBE: &str = r#"
import datetime, decimal
def describe(v):
    if isinstance(v, bool): return {"bool": v}
    if isinstance(v, decimal.Decimal): return {"decimal": str(v)}
    if isinstance(v, datetime.datetime): return {"timestamp": v.replace(tzinfo=None).isoformat()}
    if isinstance(v, (bytes, bytearray)): return {"bytes": bytes(v).hex()}
    if isinstance(v, int): return {"int": v}
    if isinstance(v, float): return {"float": v}
    if isinstance(v, str): return {"str": v}
    if v is None: return {"void": None}
    if isinstance(v, dict): return {"table": {k: describe(x) for k, x in v.items()}}
    if isinstance(v, list): return {"array": [describe(x) for x in v]}
    return {"other": repr(v)}
PROPS = ["content_type", "content_encoding", "delivery_mode", "priority", "correlation_id",
         "reply_to", "message_id", "timestamp", "type", "app_id", "cluster_id"]
def message(props, body):
    return {"properties": {p: getattr(props, p) for p in PROPS},
            "headers": {k: describe(v) for k, v in (props.headers or {}).items()},
            "body": body.hex()}
"#;

const PUBLISH_EVERY_TYPE: &str = r#"
import json, sys, pika
spec = json.load(sys.stdin)
headers = {
    "decimal": decimal.Decimal("12.34"),
    "in_array": [decimal.Decimal("2.5"), "two", 3],
    "time": datetime.datetime(2023, 11, 14, 22, 13, 20),
    "raw": b"\x00\xffnul\x00",
    "table": {"deep": -1, "when": datetime.datetime(2020, 9, 13, 12, 26, 40), "flag": False},
    "int": -64,
    "big": 2 ** 40,
    "bool": True,
    "void": None,
    "text": "text \u00e9",
}
props = pika.BasicProperties(
    content_type="application/x-payment", content_encoding="identity", headers=headers,
    delivery_mode=2, priority=7, correlation_id="corr-1", reply_to="replies",
    message_id=spec["id"], timestamp=1700000001, type="payment", app_id="shop", cluster_id="c1")
body = b"not a payment \x00\xff"
connection = pika.BlockingConnection(pika.URLParameters(spec["url"]))
channel = connection.channel()
channel.confirm_delivery()
channel.basic_publish("", spec["queue"], body, props, mandatory=True)
connection.close()
print(json.dumps(message(props, body)))
"#;

const READ_ONE: &str = r#"
import json, sys, pika
spec = json.load(sys.stdin)
connection = pika.BlockingConnection(pika.URLParameters(spec["url"]))
channel = connection.channel()
method, props, body = channel.basic_get(spec["queue"], auto_ack=True)
print(json.dumps(None if method is None else message(props, body)))
connection.close()
"#;

fn python_json(script: &str, spec: serde_json::Value) -> serde_json::Value {
    let mut child = Command::new(python())
        .args(["-c", &format!("{DESCRIBE}\n{script}")])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(spec.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "pika failed");
    serde_json::from_slice(&out.stdout).expect("pika's JSON")
}

/// Publishes to `queue`, from pika, a message with every basic property
/// and a header of each AMQP type pika writes (decimals, timestamps, byte
/// arrays with NUL, nested tables and arrays, integers, booleans (pika
/// writes no floats: the lapin tests cover them),
/// void); returns it as pika describes it.
pub fn publish_every_type(queue: &str, id: &str) -> serde_json::Value {
    python_json(
        PUBLISH_EVERY_TYPE,
        serde_json::json!({"url": super::amqp_url(), "queue": queue, "id": id}),
    )
}

/// Takes one message off `queue` with pika: as pika describes it (`null`
/// when the queue is empty).
pub fn read_one(queue: &str) -> serde_json::Value {
    python_json(
        READ_ONE,
        serde_json::json!({"url": super::amqp_url(), "queue": queue}),
    )
}

/// Asserts that `back`, read by pika, carries `sent`'s body, every basic
/// property, and every header with its type and value.
pub fn assert_same(sent: &serde_json::Value, back: &serde_json::Value) {
    assert_eq!(back["body"], sent["body"], "body");
    for (name, value) in sent["properties"].as_object().unwrap() {
        assert_eq!(&back["properties"][name], value, "property {name}: {back}");
    }
    for (name, value) in sent["headers"].as_object().unwrap() {
        assert_eq!(&back["headers"][name], value, "header {name}: {back}");
    }
}
