"""batchfit inside a user's training: ElasticStep (an optimizer step that shrinks its
micro-batches instead of running out of memory), the Lightning callback and the Hugging Face
Trainer integration. The top of the library: it may call any engine."""
