//! The local three-node RabbitMQ cluster of `scripts/rabbitmq-cluster.sh`
//! (amqps on node 1, a TLS-only Redis beside it): addresses, certificates,
//! and node stops for the TLS and failover tests. A test that cannot reach it
//! fails with the command that starts it.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

pub const START_CLUSTER: &str = "start it with `scripts/rabbitmq-cluster.sh start` \
     (or `docker compose -f docker-compose.cluster.yml up -d`; `.ci/run` starts it)";

/// The plain AMQP port of node `n` (1..=3).
pub fn port(n: usize) -> u16 {
    5680 + n as u16
}

/// The URL of node `n`.
pub fn node_url(n: usize) -> String {
    format!("amqp://guest:guest@127.0.0.1:{}/%2f", port(n))
}

/// The three node URLs, comma-separated, as `AMQP_URL` takes them.
pub fn all_nodes() -> String {
    (1..=3).map(node_url).collect::<Vec<_>>().join(",")
}

/// Node 1's TLS listener, by the name its certificate carries.
pub const AMQPS_URL: &str = "amqps://guest:guest@localhost:5691/%2f";
/// The Redis that speaks only TLS and asks for a client certificate.
pub const REDISS_PORT: u16 = 6390;

/// A file of the certificates the script generated (`ca.pem`,
/// `wrong-ca.pem`, `client.pem`, `client.key`, ...).
pub fn cert(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/rabbitmq-cluster/certs")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: the cluster's certificates are made by `scripts/rabbitmq-cluster.sh start`",
        path.display()
    );
    path
}

pub fn read_cert(name: &str) -> Vec<u8> {
    std::fs::read(cert(name)).unwrap()
}

/// Connects to node `n`, failing the test with how to start the cluster.
pub async fn connect(n: usize) -> Connection {
    let url = node_url(n);
    Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| {
            panic!("cluster node {n} is not reachable at {url}: {e}\n{START_CLUSTER}")
        })
}

/// Fails the test unless all three nodes answer. A cluster that is not
/// running is started first (once per test binary), with the script.
pub async fn require() {
    static STARTED: tokio::sync::Mutex<bool> = tokio::sync::Mutex::const_new(false);
    let mut started = STARTED.lock().await;
    let reachable = match Connection::connect(&node_url(1), ConnectionProperties::default()).await {
        Ok(probe) => {
            let _ = probe.close(200, "probe".into()).await;
            true
        }
        Err(_) => false,
    };
    if !reachable && !*started {
        *started = true;
        eprintln!("the local cluster is not running: scripts/rabbitmq-cluster.sh start");
        let out = tokio::task::spawn_blocking(|| script().arg("start").output())
            .await
            .unwrap();
        match out {
            Ok(out) if out.status.success() => {}
            other => panic!("cannot start the local cluster ({other:?})\n{START_CLUSTER}"),
        }
    }
    drop(started);
    for n in 1..=3 {
        let connection = connect(n).await;
        let _ = connection.close(200, "probe".into()).await;
    }
}

fn script() -> Command {
    Command::new(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/rabbitmq-cluster.sh"))
}

/// Runs the cluster script with `args`; panics with its output on failure.
pub fn run(args: &[&str]) -> String {
    let out = script()
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run scripts/rabbitmq-cluster.sh: {e}"));
    assert!(
        out.status.success(),
        "scripts/rabbitmq-cluster.sh {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `rabbitmqctl` against node `n`.
pub fn ctl(n: usize, args: &[&str]) -> String {
    let mut all = vec!["ctl".to_owned(), n.to_string()];
    all.extend(args.iter().map(|a| a.to_string()));
    run(&all.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The node (1..=3) that holds the leader of quorum queue `queue`, asked of
/// the `running` nodes in turn.
pub fn leader_of(queue: &str, running: &[usize]) -> usize {
    for &n in running {
        let out = script()
            .args(["ctl", &n.to_string(), "list_queues", "name", "leader", "-q"])
            .args(["--no-table-headers"])
            .output()
            .expect("run the cluster script");
        let listing = String::from_utf8_lossy(&out.stdout);
        if let Some(line) = listing
            .lines()
            .find(|line| line.split('\t').next() == Some(queue))
        {
            for candidate in 1..=3 {
                // The script's nodes, or those of docker-compose.cluster.yml.
                if line.contains(&format!("idempo-{candidate}@"))
                    || line.contains(&format!("@rabbit-{candidate}"))
                {
                    return candidate;
                }
            }
        }
    }
    panic!("no running node of {running:?} names a leader for {queue}")
}

/// Waits until node `n`'s member of quorum queue `queue` is online again (as
/// the `running` nodes see it), so that stopping another node leaves the
/// queue a majority. A restarted node runs before its queue members rejoin.
pub async fn wait_member_online(queue: &str, n: usize, running: &[usize]) {
    let started = std::time::Instant::now();
    loop {
        for &asked in running {
            let out = script()
                .args([
                    "ctl",
                    &asked.to_string(),
                    "list_queues",
                    "name",
                    "online",
                    "-q",
                ])
                .args(["--no-table-headers"])
                .output()
                .expect("run the cluster script");
            let listing = String::from_utf8_lossy(&out.stdout);
            let online = listing
                .lines()
                .find(|line| line.split('\t').next() == Some(queue))
                .is_some_and(|line| {
                    line.contains(&format!("idempo-{n}@")) || line.contains(&format!("@rabbit-{n}"))
                });
            if online {
                return;
            }
        }
        assert!(
            started.elapsed() < NODE_TIMEOUT,
            "node {n}'s member of {queue} did not come back online within {NODE_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Stops node `n` cleanly (as a maintenance or a lost host would, to its
/// clients: their connections close).
pub fn stop_node(n: usize) {
    run(&["stop-node", &n.to_string()]);
}

/// Starts node `n` again and waits until it runs.
pub fn start_node(n: usize) {
    run(&["start-node", &n.to_string()]);
}

/// A bound for node starts and stops in the tests.
pub const NODE_TIMEOUT: Duration = Duration::from_secs(120);
