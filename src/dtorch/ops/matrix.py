"""(op family: matrix) - being written."""
