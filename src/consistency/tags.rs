//! Surrogate keys: the origin tags an answer with `Surrogate-Key: a b c` (space-separated,
//! as Fastly reads it) and/or `Cache-Tag: a,b,c` (comma-separated, as Cloudflare reads it).
//! A cached answer keeps its tags, so invalidating a tag drops every entry that carried it;
//! a write's answer names the tags the write invalidates. Both headers are internal to the
//! origin and the cache: they are removed before an answer reaches a client.

use http::HeaderMap;
use http::header::HeaderName;

pub(crate) static SURROGATE_KEY: HeaderName = HeaderName::from_static("surrogate-key");
pub(crate) static CACHE_TAG: HeaderName = HeaderName::from_static("cache-tag");

/// At most this many tags are kept per answer; more are ignored (and logged by the caller).
pub(crate) const MAX_TAGS: usize = 64;
/// Longer tags are ignored.
pub(crate) const MAX_TAG_BYTES: usize = 1024;

/// What [`take`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Tags {
    /// Distinct tags, in order of appearance.
    pub(crate) tags: Vec<String>,
    /// Tags dropped for being too long, not UTF-8, or over [`MAX_TAGS`].
    pub(crate) ignored: usize,
}

/// Removes the tag headers from `headers` and returns their tags.
pub(crate) fn take(headers: &mut HeaderMap) -> Tags {
    let mut found = Tags::default();
    for (name, separators) in [(&SURROGATE_KEY, &[' ', '\t'][..]), (&CACHE_TAG, &[','][..])] {
        for value in headers.get_all(name) {
            let Ok(text) = value.to_str() else {
                found.ignored += 1;
                continue;
            };
            for tag in text
                .split(separators)
                .map(str::trim)
                .filter(|t| !t.is_empty())
            {
                if tag.len() > MAX_TAG_BYTES || found.tags.len() >= MAX_TAGS {
                    found.ignored += 1;
                } else if !found.tags.iter().any(|t| t == tag) {
                    found.tags.push(tag.to_owned());
                }
            }
        }
        headers.remove(name);
    }
    found
}

/// Whether `tag` is acceptable as a surrogate key given over the admin API or a stream.
pub(crate) fn valid(tag: &str) -> bool {
    !tag.is_empty() && tag.len() <= MAX_TAG_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn both_headers_are_read_and_removed() {
        let mut h = HeaderMap::new();
        h.insert(&SURROGATE_KEY, HeaderValue::from_static("item-7  items"));
        h.append(&CACHE_TAG, HeaderValue::from_static("items, shop:3"));
        h.insert("content-type", HeaderValue::from_static("text/plain"));
        let found = take(&mut h);
        assert_eq!(found.tags, ["item-7", "items", "shop:3"]);
        assert_eq!(found.ignored, 0);
        assert!(h.get(&SURROGATE_KEY).is_none() && h.get(&CACHE_TAG).is_none());
        assert!(h.get("content-type").is_some());
    }

    #[test]
    fn oversized_and_excess_tags_are_ignored() {
        let mut h = HeaderMap::new();
        let long = "x".repeat(MAX_TAG_BYTES + 1);
        let many: Vec<String> = (0..MAX_TAGS + 3).map(|i| format!("t{i}")).collect();
        h.insert(
            &SURROGATE_KEY,
            HeaderValue::from_str(&format!("{long} {}", many.join(" "))).unwrap(),
        );
        let found = take(&mut h);
        assert_eq!(found.tags.len(), MAX_TAGS);
        assert_eq!(found.ignored, 4);
    }
}
