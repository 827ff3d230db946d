"""The torch-free client: channels, auth, errors, the generated stubs; also the `tandem_client` wheel."""
