"""``ferry.DataLoader``: worker processes collate batches straight into a process-shared pinned ring."""
