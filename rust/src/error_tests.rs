//! Tests of the core error messages.

use super::*;

#[test]
fn messages_name_the_argument() {
    let e = CoreError::invalid("max_tokens", "must be >= 1, got 0");
    assert_eq!(e.to_string(), "max_tokens: must be >= 1, got 0");
    assert!(CoreError::QueueFull { max_len: 3 }
        .to_string()
        .contains('3'));
    assert!(CoreError::DuplicateRequest("a".into())
        .to_string()
        .contains("\"a\""));
    assert_eq!(
        CoreError::from(crate::sched::block::OutOfBlocks),
        CoreError::OutOfBlocks
    );
}
