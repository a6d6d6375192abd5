//! `idempo dashboard` in a real browser: headless Chromium (Debian's
//! `chromium` and `chromium-driver`; `.ci/run` installs them) signs in with
//! the token, opens the overview and the dead-letter group the `payments`
//! example left, replays the group through the confirmation, and the test
//! checks in PostgreSQL that every payment applied exactly once. The
//! screenshots it takes go to `target/dashboard-screenshots/` (or
//! `$IDEMPO_SCREENSHOTS_DIR`: `docs/` refreshes the README's).

mod support;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use support::cli::dashboard;
use support::example::{doubled_payments, fill_dead_letter_table, spawn_example};
use support::{Broker, eventually, unique};

const INSTALL: &str = "install Chromium and its driver: `apt-get install -y chromium chromium-driver` \
     (`.ci/run` does), or set CHROMEDRIVER to a chromedriver and CHROMIUM to its browser";

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn chromedriver() -> (Killed, String) {
    let binary = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
    let port = free_port();
    let child = Killed(
        Command::new(&binary)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {binary}: {e}\n{INSTALL}")),
    );
    let url = format!("http://127.0.0.1:{port}");
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return (child, url);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{binary} did not listen on {port}\n{INSTALL}");
}

fn screenshots() -> PathBuf {
    let dir = std::env::var("IDEMPO_SCREENSHOTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/dashboard-screenshots")
        });
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A headless Chromium session through `driver_url`.
async fn browser(driver_url: &str) -> fantoccini::Client {
    let mut chrome = serde_json::json!({
        "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,800"],
    });
    if let Ok(binary) = std::env::var("CHROMIUM") {
        chrome["binary"] = binary.into();
    } else if std::path::Path::new("/usr/bin/chromium").exists() {
        chrome["binary"] = "/usr/bin/chromium".into();
    }
    let mut caps = serde_json::Map::new();
    caps.insert("goog:chromeOptions".into(), chrome);
    ClientBuilder::new(HttpConnector::new())
        .capabilities(caps)
        .connect(driver_url)
        .await
        .unwrap_or_else(|e| panic!("cannot start a browser session: {e}\n{INSTALL}"))
}

#[tokio::test]
async fn an_operator_replays_a_group_in_the_browser_and_each_payment_applies_once() {
    let db = support::cli::payments_db().await;
    let (broker, queue) = (Broker::connect().await, unique("q"));
    let load = fill_dead_letter_table(&db, &broker, &queue, 25, 0).await;

    let (_driver, driver_url) = chromedriver();
    let dashboard = dashboard(&db, &["--token", "browser-token", "--sample-every", "1s"]);
    let board = dashboard.url.clone();
    let browser = browser(&driver_url).await;

    let run = async {
        // Signed out: the sign-in page; the token signs in.
        browser.goto(&format!("{board}/")).await?;
        browser
            .find(Locator::Css("input[name=token]"))
            .await?
            .send_keys("browser-token")
            .await?;
        browser
            .find(Locator::Css("form[action='/login'] button"))
            .await?
            .click()
            .await?;
        // Waited for: the click returns before the overview loads.
        browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::XPath("//h1[. = 'Overview']"))
            .await?;
        let overview = browser.source().await?;
        assert!(
            overview.contains("Overview") && overview.contains(&queue),
            "{overview}"
        );
        browser
            .goto(&format!("{board}/dead-letters?queue={queue}"))
            .await?;
        let groups = browser.source().await?;
        assert!(groups.contains("max attempts exceeded"), "{groups}");
        assert!(groups.contains(">25<"), "the group counts 25: {groups}");
        browser.find(Locator::Css("a.group")).await?.click().await?;
        browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::XPath("//h1[. = 'Dead letters of one cause']"))
            .await?;
        std::fs::write(
            screenshots().join("dashboard-dead-letters.png"),
            browser.screenshot().await?,
        )
        .unwrap();

        let _working = spawn_example(&db.url, &queue, &[("PAYMENTS_DEAD_LETTERS", "table")]);
        browser
            .find(Locator::Css("form[action='/dead-letters/replay'] button"))
            .await?
            .click()
            .await?;
        // The confirmation page (waited for: the click returns before it loads).
        let confirm = browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::XPath("//button[contains(., 'Replay 25')]"))
            .await?;
        confirm.click().await?;
        let done = browser
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css("p.result"))
            .await?
            .text()
            .await?;
        assert!(done.contains("25 replayed"), "{done}");
        eventually("every payment applied", Duration::from_secs(60), || async {
            db.payments().await == load.ids.len() as i64
        })
        .await;

        // The overview with the consumer at work: its process and charts.
        browser.goto(&format!("{board}/")).await?;
        let overview = browser.source().await?;
        assert!(
            overview.contains("<td><bdi>consuming</bdi></td>"),
            "{overview}"
        );
        std::fs::write(
            screenshots().join("dashboard-overview.png"),
            browser.screenshot().await?,
        )
        .unwrap();
        // A phone-width window: the page does not scroll sideways (wide
        // tables scroll inside themselves).
        browser.set_window_size(390, 844).await?;
        browser.goto(&format!("{board}/")).await?;
        let fits = browser
            .execute(
                "return document.documentElement.scrollWidth <= window.innerWidth + 1;",
                vec![],
            )
            .await?;
        assert_eq!(
            fits,
            serde_json::Value::Bool(true),
            "the overview fits 390 px"
        );
        std::fs::write(
            screenshots().join("dashboard-phone.png"),
            browser.screenshot().await?,
        )
        .unwrap();
        Ok::<(), fantoccini::error::CmdError>(())
    }
    .await;
    let closed = browser.close().await;
    run.expect("the browser session");
    closed.expect("close the browser session");
    assert_eq!(doubled_payments(&db).await, 0);
    assert_eq!(db.balances().await, load.expected);
    let live: i64 = db
        .count("SELECT count(*) FROM dead_letters WHERE state = 'live'")
        .await;
    assert_eq!(live, 0);
}

/// Hostile text in every field the dashboard shows, rendered by a real
/// browser: no script runs, no markup is injected, a right-to-left override
/// does not reverse the text around it, control characters show escaped.
#[tokio::test]
async fn hostile_letters_are_shown_as_text_in_the_browser() {
    let db = support::cli::payments_db().await;
    let queue = format!("{}\"'><svg onload=window.pwned=1>", unique("q"));
    let fingerprint = "\"><script>window.pwned=2</script>";
    let long = "x".repeat(1_000_000);
    let hostile = [
        (
            "<script>window.pwned=3</script>",
            "\"><img src=x onerror=\"window.pwned=4\">",
        ),
        (
            "javascript:window.pwned=5",
            "<a href=\"javascript:window.pwned=6\">click</a>",
        ),
        ("bill\u{202e}fdp.exe", "ESC\u{1b}[31mred\u{7}"),
        ("long", long.as_str()),
    ];
    for (message_id, error) in hostile {
        sqlx::query(
            "INSERT INTO dead_letters (consumer, queue, message_id, payload_sha256, exchange, \
                 routing_key, properties, headers, body, reason, error, fingerprint, attempts, \
                 first_failed_at, last_failed_at) \
             VALUES ($1, $1, $2, sha256($2::bytea), '', $1, '\\x0000', \
                 '{\"x-evil\": \"<script>window.pwned=7</script>\"}', $3, \
                 '<b onmouseover=window.pwned=8>reason</b>', $4, $5, 1, now(), now())",
        )
        .bind(&queue)
        .bind(message_id)
        .bind(format!("<script>window.pwned=9</script>{message_id}").into_bytes())
        .bind(error)
        .bind(fingerprint)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let row: i64 = sqlx::query_scalar("SELECT min(id) FROM dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let (_driver, driver_url) = chromedriver();
    let dashboard = dashboard(&db, &[]);
    let board = dashboard.url.clone();
    let browser = browser(&driver_url).await;
    let run = async {
        let group = format!(
            "{board}/dead-letters/group?queue={}&fingerprint={}",
            urlencoding(&queue),
            urlencoding(fingerprint)
        );
        for page in [
            format!("{board}/dead-letters"),
            group,
            format!("{board}/dead-letters/{row}"),
            format!("{board}/dead-letters/{}", row + 2),
        ] {
            browser.goto(&page).await?;
            let pwned = browser
                .execute("return window.pwned === undefined;", vec![])
                .await?;
            assert_eq!(pwned, serde_json::Value::Bool(true), "a script ran on {page}");
            let injected = browser
                .execute(
                    "return document.querySelectorAll('main script, main img, main svg:not(.chart), main b').length;",
                    vec![],
                )
                .await?;
            assert_eq!(injected, serde_json::json!(0), "markup injected on {page}");
        }
        // The text as text: the override escaped, the controls shown.
        browser.goto(&format!("{board}/dead-letters/{}", row + 2)).await?;
        let text = browser.find(Locator::Css("main")).await?.text().await?;
        assert!(text.contains("bill\\u{202e}fdp.exe"), "{text}");
        assert!(text.contains("\\u{1b}[31mred\\u{7}"), "{text}");
        assert!(!text.contains('\u{202e}') && !text.contains('\u{1b}'), "{text}");
        browser.goto(&format!("{board}/dead-letters/{row}")).await?;
        let text = browser.find(Locator::Css("main")).await?.text().await?;
        assert!(text.contains("<script>window.pwned=3</script>"), "{text}");
        Ok::<(), fantoccini::error::CmdError>(())
    }
    .await;
    let closed = browser.close().await;
    run.expect("the browser session");
    closed.expect("close the browser session");
}

/// `text` percent-encoded for a query value.
fn urlencoding(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
