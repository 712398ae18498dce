"""Worker side: runs under torchrun's elastic agent, one process per rank."""
