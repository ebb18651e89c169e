"""The options of every gRPC channel and server between the scheduler and the workers."""

# A step that admits many long prompts in full (token ids, block tables) can pass gRPC's
# 4 MiB default.
GRPC_OPTIONS = (("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20))
