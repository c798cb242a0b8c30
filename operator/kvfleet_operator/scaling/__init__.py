"""The autoscaler: a pure policy (`policy`), signal readers (`observe`) and the tick that
ties them to the reconcile (`autoscaler`). The fleet simulator drives `policy` itself."""
