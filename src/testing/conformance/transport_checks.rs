//! The transport kit's checks, one method each: what a consumer on any
//! transport must show (run by [`Report::transport`](super::Report::transport)).

use std::time::{Duration, Instant};

use super::transport::{
    DELAY, Fail, Kit, KitBody, PATIENCE, TransportUnderTest, settled, stop, wait,
};
use super::{Failure, expect_eq, unexpected};
use crate::consumer::{DeadLetterReason, RuntimeState};

impl<U: TransportUnderTest> Kit<'_, U> {
    pub(super) async fn exactly_once(&self, check: &str) -> Result<bool, Failure> {
        let source = self.source(check);
        let Some(c) = self.start(&source, Some).await? else {
            return Ok(false);
        };
        let body = KitBody::default();
        self.publish(&source, "once-a", &body).await?;
        self.publish(&source, "once-a", &body).await?;
        self.publish(&source, "once-b", &body).await?;
        settled(&c, "the three deliveries settle", |s| {
            s.processed + s.duplicates >= 3
        })
        .await?;
        expect_eq(
            "once-a's effects",
            self.effects(&source, "once-a").await?,
            1,
        )?;
        expect_eq(
            "once-b's effects",
            self.effects(&source, "once-b").await?,
            1,
        )?;
        expect_eq("the duplicates counted", c.stats.snapshot().duplicates, 1)?;
        stop(c).await
    }

    pub(super) async fn group_order(&self, check: &str) -> Result<bool, Failure> {
        let source = self.source(check);
        let Some(c) = self.start_grouped(&source).await? else {
            return Ok(false);
        };
        let ids: Vec<String> = (0..12).map(|i| format!("group-{i:02}")).collect();
        for id in &ids {
            let body = KitBody {
                sleep_ms: 20,
                ..KitBody::default()
            };
            self.publish_with(&source, id, &[("x-group-id", "g")], &body)
                .await?;
        }
        settled(&c, "the group", |s| s.processed >= 12).await?;
        let seen = c.attempts.lock().expect("not poisoned").clone();
        let mut order: Vec<(Instant, &String)> = ids.iter().map(|id| (seen[id][0], id)).collect();
        order.sort();
        let ran: Vec<&String> = order.into_iter().map(|(_, id)| id).collect();
        expect_eq("the group's order", ran, ids.iter().collect())?;
        stop(c).await
    }

    pub(super) async fn retry_later(&self, check: &str) -> Result<bool, Failure> {
        let source = self.source(check);
        let Some(c) = self.start(&source, Some).await? else {
            return Ok(false);
        };
        let body = KitBody {
            fail: Fail::Once,
            ..KitBody::default()
        };
        self.publish(&source, "retry-a", &body).await?;
        settled(&c, "the retry is processed", |s| s.processed >= 1).await?;
        expect_eq(
            "retry-a's effects",
            self.effects(&source, "retry-a").await?,
            1,
        )?;
        let seen = c.attempts.lock().expect("not poisoned")["retry-a"].clone();
        expect_eq("retry-a's attempts", seen.len(), 2)?;
        let waited = seen[1] - seen[0];
        if waited < DELAY {
            return Err(unexpected(
                "the second attempt",
                format!("at least {DELAY:?} after the first"),
                waited,
            ));
        }
        stop(c).await
    }

    pub(super) async fn dead_letter(&self, check: &str) -> Result<bool, Failure> {
        let source = self.source(check);
        let Some(c) = self.start(&source, Some).await? else {
            return Ok(false);
        };
        let body = KitBody {
            fail: Fail::Always,
            ..KitBody::default()
        };
        self.publish(&source, "dead-a", &body).await?;
        settled(&c, "the dead letter", |s| s.dead_lettered >= 1).await?;
        expect_eq(
            "dead-a's letter",
            self.letter_reason(&source, "dead-a").await?.as_deref(),
            Some(DeadLetterReason::PermanentError.as_str()),
        )?;
        expect_eq(
            "dead-a's effects",
            self.effects(&source, "dead-a").await?,
            0,
        )?;
        stop(c).await
    }

    pub(super) async fn poison(&self, check: &str) -> Result<bool, Failure> {
        let source = self.source(check);
        let Some(c) = self.start(&source, Some).await? else {
            return Ok(false);
        };
        self.under_test
            .publish(&source, "poison-a", &[], b"{not json")
            .await
            .map_err(|e| unexpected("publish the poison", "published", e))?;
        for id in ["poison-b", "poison-c", "poison-d"] {
            self.publish(&source, id, &KitBody::default()).await?;
        }
        settled(&c, "the good ones and the letter", |s| {
            s.processed >= 3 && s.dead_lettered >= 1
        })
        .await?;
        expect_eq(
            "the poison's letter",
            self.letter_reason(&source, "poison-a").await?.as_deref(),
            Some(DeadLetterReason::UndecodableBody.as_str()),
        )?;
        for id in ["poison-b", "poison-c", "poison-d"] {
            expect_eq(
                &format!("{id}'s effects"),
                self.effects(&source, id).await?,
                1,
            )?;
        }
        stop(c).await
    }

    pub(super) async fn graceful_stop(&self, check: &str) -> Result<bool, Failure> {
        let source = self.source(check);
        let Some(c) = self.start(&source, Some).await? else {
            return Ok(false);
        };
        let body = KitBody {
            sleep_ms: 800,
            ..KitBody::default()
        };
        self.publish(&source, "drain-a", &body).await?;
        wait("the handler starts", || {
            c.attempts
                .lock()
                .expect("not poisoned")
                .contains_key("drain-a")
        })
        .await?;
        let attempts = c.attempts.clone();
        stop(c).await?;
        expect_eq(
            "drain-a's effects after the stop",
            self.effects(&source, "drain-a").await?,
            1,
        )?;
        // Settled before the stop returned: a new consumer gets nothing.
        let Some(again) = self.start(&source, Some).await? else {
            return Ok(false);
        };
        tokio::time::sleep(Duration::from_secs(2)).await;
        expect_eq(
            "deliveries after the restart",
            again.stats.snapshot().deliveries,
            0,
        )?;
        expect_eq(
            "drain-a's attempts",
            attempts.lock().expect("not poisoned")["drain-a"].len(),
            1,
        )?;
        stop(again).await
    }

    pub(super) async fn reconnects(&self, check: &str) -> Result<bool, Failure> {
        let source = self.source(check);
        let Some(c) = self.start(&source, Some).await? else {
            return Ok(false);
        };
        self.publish(&source, "cut-a", &KitBody::default()).await?;
        settled(&c, "before the cut", |s| s.processed >= 1).await?;
        if !self.under_test.cut(&source).await {
            stop(c).await?;
            return Ok(false);
        }
        let consuming = c
            .health
            .wait_for(|h| h.reconnects > 0 && h.state == RuntimeState::Consuming);
        if tokio::time::timeout(PATIENCE, consuming).await.is_err() {
            return Err(unexpected(
                "after the cut",
                "consuming again",
                c.health.snapshot(),
            ));
        }
        self.publish(&source, "cut-b", &KitBody::default()).await?;
        settled(&c, "after the cut", |s| s.processed >= 2).await?;
        for id in ["cut-a", "cut-b"] {
            expect_eq(
                &format!("{id}'s effects"),
                self.effects(&source, id).await?,
                1,
            )?;
        }
        stop(c).await
    }

    pub(super) async fn forwards(&self, check: &str) -> Result<bool, Failure> {
        let source = self.source(check);
        let destination = format!("{source}_to");
        let started = self
            .start(&source, |b| self.under_test.forward_to(b, &destination))
            .await?;
        let Some(c) = started else {
            return Ok(false);
        };
        let body = KitBody {
            forward_to: Some(destination.clone()),
            ..KitBody::default()
        };
        for id in ["forward-a", "forward-b"] {
            self.publish(&source, id, &body).await?;
        }
        settled(&c, "the forwarding handlers", |s| s.processed >= 2).await?;
        let expected: Vec<String> = ["forward-a", "forward-b"]
            .iter()
            .map(|id| crate::outbox::derived_message_id(id, "kit"))
            .collect();
        let deadline = Instant::now() + PATIENCE;
        loop {
            let got = self
                .under_test
                .received(&destination)
                .await
                .map_err(|e| unexpected("read the destination", "its messages", e))?;
            if expected.iter().all(|id| got.contains(id)) {
                if got.iter().any(|id| !expected.contains(id)) {
                    return Err(unexpected("the destination", format!("{expected:?}"), got));
                }
                break;
            }
            if Instant::now() > deadline {
                return Err(unexpected(
                    "the destination",
                    format!("{expected:?}, each with the id derived from its original"),
                    got,
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        stop(c).await
    }
}
