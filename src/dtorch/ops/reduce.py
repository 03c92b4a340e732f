"""(op family: reduce) - being written."""
