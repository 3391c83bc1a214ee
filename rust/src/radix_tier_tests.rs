//! Tests of the tiered radix cache (demote, promote, restore, invalidate).

use super::*;
