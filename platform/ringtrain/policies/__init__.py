"""Pure decisions: (status, now) -> Decision. Imports neither torch nor ray."""
