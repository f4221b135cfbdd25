"""One head, one example: attend, attention, softmax, layouts, checks, the Modifiers value."""
