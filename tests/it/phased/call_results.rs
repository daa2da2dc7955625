//! A call's result is recorded whatever the response bound says: the call
//! was made, and a result refused would make it again on the next attempt
//! (or park an at-most-once call). The bound still holds for what the
//! operation stores as its response.

use std::convert::Infallible;

use super::*;

crate::common::backend_tests!(a_call_result_beyond_the_response_bound_is_recorded_and_the_call_is_never_made_again);

fn a_call_result_beyond_the_response_bound_is_recorded_and_the_call_is_never_made_again<D: TestDb>() {
    let db = D::new();
    let mut conn = db.conn();
    let phased = Phased::new("fetch-document").config(Config::default().max_response_len(64));
    for at_most_once in [false, true] {
        let key = format!("document-{at_most_once}");
        let calls = AtomicUsize::new(0);
        // `whole`: the operation answers with the document itself, beyond
        // the bound, instead of its length.
        let fetch = |conn: &mut D::Conn, whole: bool| {
            phased.run(conn, SCOPE, &key, &"report", |s| {
                let provider = |_: &str| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Infallible>("x".repeat(100))
                };
                let document = if at_most_once {
                    s.call_at_most_once("fetched", provider)?
                } else {
                    s.call("fetched", provider)?
                };
                s.finish(|_| Ok(if whole { document } else { document.len().to_string() }))
            })
        };
        let refused = fetch(&mut conn, true);
        assert!(
            matches!(refused, Err(Error::ResponseTooLarge { len: 102, max: 64 })),
            "the response is bounded: {refused:?}"
        );
        let fetched = fetch(&mut conn, false);
        assert_eq!(
            fetched.expect("the retry finishes"),
            Outcome::Executed(String::from("100"))
        );
        let replayed = fetch(&mut conn, false);
        assert_eq!(replayed.expect("a replay"), Outcome::Replayed(String::from("100")));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "the call was made once (at most once: {at_most_once})"
        );
    }
}
