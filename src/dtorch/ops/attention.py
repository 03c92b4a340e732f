"""(op family: attention) - being written."""
