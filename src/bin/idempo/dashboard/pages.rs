//! The dashboard's HTML, rendered on the server with maud, which escapes
//! every value it interpolates; no script needed to use a page (the
//! embedded script only refreshes them). Text from the queues, the tables
//! and the services goes through [`untrusted`]: escaped control and bidi
//! characters, in a `<bdi>` of its own.

use std::borrow::Cow;

use idempo::ops::{Condition, short_duration};
use maud::{DOCTYPE, Markup, PreEscaped, html};

/// The stylesheet, embedded: the dashboard works air-gapped.
pub(crate) const STYLE: &str = include_str!("style.css");

/// Refreshes `main` every 5 s without a full reload (pages work without it).
pub(crate) const SCRIPT: &str = include_str!("refresh.js");

/// The colour of what [`idempo::ops`] decided: the rule beside it says why.
pub(crate) fn colour(condition: Condition) -> &'static str {
    match condition {
        Condition::Attention => "red",
        Condition::Stopped => "muted",
        _ => "green",
    }
}

/// The outbox's rule and its counts, coloured by what `ops` decided: the
/// overview and the outbox page show the same lines.
pub(crate) fn outbox_summary(status: &idempo::outbox::OutboxStatus) -> Markup {
    html! {
        p class="rule" {
            "red: a failed message, or the oldest pending one older than "
            (short_duration(Condition::OUTBOX_PENDING_LIMIT))
        }
        p class=(colour(Condition::of_outbox(status))) {
            (status.pending) " pending, " (status.failed) " failed, oldest pending "
            (status.oldest_pending_age.map_or("-".into(), short_duration))
        }
    }
}

/// The page around `body` (HTML rendered by this module).
pub(crate) fn layout(title: &str, body: &str, refresh: bool) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · idempo" }
                link rel="stylesheet" href="/assets/style.css";
                @if refresh {
                    script src="/assets/refresh.js" defer {}
                }
            }
            body {
                header {
                    a href="/" class="brand" { "idempo" }
                    nav {
                        a href="/" { "Overview" }
                        a href="/dead-letters" { "Dead letters" }
                        a href="/outbox" { "Outbox" }
                    }
                }
                main id="main" data-refresh[refresh] { (PreEscaped(body)) }
            }
        }
    }
    .into_string()
}

/// Text that came from outside the dashboard (queue names, message ids,
/// errors, headers, bodies): in a `<bdi>` of its own, so that a
/// right-to-left override inside cannot reorder the text around it, and
/// with its control and bidi control characters shown escaped
/// (`\u{1b}`, `\n`, `\u{202e}`) instead of acting on the page. maud
/// escapes the rest (`<`, `&`, quotes).
pub(crate) fn untrusted(text: &str) -> Markup {
    html! { bdi { (defang(text, false)) } }
}

/// A body as text: as [`untrusted`], its line breaks and tabs kept (a
/// pretty-printed JSON body stays readable inside `<pre>`).
pub(crate) fn untrusted_body(text: &str) -> Markup {
    html! { bdi { (defang(text, true)) } }
}

/// The bidi control characters (Unicode's `Bidi_Control`): ALM, LRM, RLM,
/// the embeddings and overrides U+202A–U+202E, the isolates U+2066–U+2069.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with its control characters as Rust escapes them (`\n`,
/// `\u{1b}`) and its bidi control characters as `\u{202e}`; the other
/// characters as they are.
fn defang(text: &str, keep_layout: bool) -> Cow<'_, str> {
    let kept = |c: char| keep_layout && matches!(c, '\n' | '\t');
    if !text
        .chars()
        .any(|c| (c.is_control() && !kept(c)) || is_bidi_control(c))
    {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if kept(c) {
            out.push(c);
        } else if c.is_control() {
            out.extend(c.escape_debug());
        } else if is_bidi_control(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A time as the pages show it, `-` when unknown.
pub(crate) fn time(t: Option<std::time::SystemTime>) -> String {
    t.map_or_else(
        || "-".into(),
        |t| humantime::format_rfc3339_millis(t).to_string(),
    )
}

/// A value, or `-` when there is none.
pub(crate) fn or_dash(value: Option<impl ToString>) -> String {
    value.map_or_else(|| "-".into(), |v| v.to_string())
}

/// A form that POSTs an action, with the CSRF token.
pub(crate) fn action(path: &str, csrf: &str, fields: &[(&str, &str)], label: &str) -> Markup {
    html! {
        form method="post" action=(path) {
            input type="hidden" name="csrf" value=(csrf);
            @for (name, value) in fields {
                input type="hidden" name=(name) value=(value);
            }
            button type="submit" { (label) }
        }
    }
}

/// The confirmation step of an action: what it would do, and the button.
/// The confirmation of `what` on `count` `items` ("dead letter(s)"): the
/// action's form again with `confirm`, or back to `cancel`.
pub(crate) fn confirm(
    (what, count, items): (&str, u64, &str),
    path: &str,
    cancel: &str,
    csrf: &str,
    fields: &[(&str, &str)],
) -> String {
    let mut fields = fields.to_vec();
    fields.push(("confirm", "1"));
    html! {
        h1 { "Confirm" }
        p { (what) " " (count) " " (items) "?" }
        (action(path, csrf, &fields, &format!("{what} {count}")))
        p { a href=(cancel) { "Cancel" } }
    }
    .into_string()
}

/// What an action did.
pub(crate) fn done(message: &str) -> String {
    html! {
        h1 { "Done" }
        p class="result" { (untrusted(message)) }
        p { a href="/dead-letters" { "Back to the dead letters" } }
    }
    .into_string()
}

pub(crate) fn login(failed: bool) -> String {
    html! {
        h1 { "Sign in" }
        @if failed {
            p class="red" { "That is not the token." }
        }
        form method="post" action="/login" {
            label { "Token " input type="password" name="token" autofocus; }
            button type="submit" { "Sign in" }
        }
    }
    .into_string()
}

/// A query-string value, percent-encoded.
pub(crate) fn urlencode(value: &str) -> String {
    form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untrusted_text_is_escaped_isolated_and_its_controls_shown() {
        let shown =
            untrusted("<b>&\"q\"</b>\u{1b}[31m\n\u{202e}evil\u{2066}\u{7f}\u{0}").into_string();
        assert_eq!(
            shown,
            "<bdi>&lt;b&gt;&amp;&quot;q&quot;&lt;/b&gt;\\u{1b}[31m\\n\\u{202e}evil\\u{2066}\\u{7f}\\0</bdi>"
        );
        // Plain text (and non-ASCII that is neither) as it is.
        assert_eq!(
            untrusted("payments·é").into_string(),
            "<bdi>payments·é</bdi>"
        );
        for c in ['\u{061c}', '\u{200e}', '\u{200f}', '\u{202a}', '\u{2069}'] {
            assert!(
                !untrusted(&c.to_string()).into_string().contains(c),
                "{c:?}"
            );
        }
    }

    #[test]
    fn pages_have_no_inline_script_style_or_handler() {
        let body = login(true);
        for page in [
            layout("Sign in", &body, true),
            layout("Sign in", &body, false),
        ] {
            assert!(page.starts_with("<!DOCTYPE html>"), "{page}");
            assert!(!page.contains("style="), "{page}");
            // No event handler attribute (` onclick=`, ` onload=`, ...).
            let handler = page.split(" on").skip(1).any(|rest| {
                let name = rest.trim_start_matches(|c: char| c.is_ascii_alphabetic());
                name.len() < rest.len() && name.starts_with('=')
            });
            assert!(!handler, "{page}");
            assert_eq!(
                page.matches("<script").count(),
                page.matches("<script src=\"/assets/refresh.js\" defer></script>")
                    .count(),
                "{page}"
            );
        }
        let refreshed = layout("T<", "<p>x</p>", true);
        assert!(
            refreshed.contains("<title>T&lt; · idempo</title>"),
            "{refreshed}"
        );
        assert!(
            refreshed.contains("<main id=\"main\" data-refresh><p>x</p></main>"),
            "{refreshed}"
        );
        assert!(!layout("T", "", false).contains("data-refresh"));
        assert!(
            body.contains("<input type=\"password\" name=\"token\" autofocus>"),
            "{body}"
        );
    }
}
