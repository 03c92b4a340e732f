"""(op family: view) - being written."""
